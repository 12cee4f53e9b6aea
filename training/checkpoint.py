"""Training checkpoints: accelerate's `save_state` plus the loop's own state, published atomically.

A checkpoint is `<out_dir>/checkpoints/step_000100/` (layout in `common.run_dir`) holding
accelerate's files (model, optimizer, per-rank RNG and accumulation step), `gpt_config.json`,
`run_state.json` (step, tokens seen, tracker run id, world size), one `data_state_rank{r}.json`
per rank and, written last, `manifest.json` with every other file's size and sha256. Everything is
first written to `.tmp-step_000100/` and renamed into place only once every rank has finished
(`common.atomic.publish`), so a crash in the middle of a save leaves a temp folder that
`RunDir.latest_checkpoint` never picks (it is cleared by the next save).

Before a resume loads anything, `verify_checkpoint` checks every file against the manifest (and
that every rank's RNG and data state is there): a damaged checkpoint is one line naming the file
and the earlier checkpoint to resume from, never a traceback or a silently inexact resume.
"""
from __future__ import annotations

import hashlib
import json
import logging
import pickle
import secrets
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from accelerate import Accelerator
from accelerate.utils import load as accelerate_load
from safetensors import SafetensorError

from common.atomic import fresh_temp_dir, publish, temp_path
from common.errors import UserError
from common.run_dir import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    GPT_CONFIG,
    MANIFEST,
    RUN_STATE,
    RunDir,
    checkpoint_step,
    data_state_file,
)

FORMAT = 2  # run_state.json's "format": 2 = the checkpoint has a manifest (format 1, without, still resumes)


@dataclass
class Progress:
    """Where a run stands: optimizer steps done, tokens consumed, and the trackers' run id."""

    step: int = 0
    tokens: int = 0
    run_id: str = field(default_factory=lambda: secrets.token_hex(4))


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint chosen for resumption, with the small files that the run's setup needs."""

    path: Path
    gpt_config: dict[str, Any]  # as saved: `asdict(GPTConfig)`
    run_state: dict[str, Any]  # step, tokens, run_id, world_size
    superseded: tuple[Path, ...] = ()  # newer checkpoints of the run folder, set aside when the run starts

    @property
    def progress(self) -> Progress:
        try:
            return Progress(int(self.run_state["step"]), int(self.run_state["tokens"]), str(self.run_state["run_id"]))
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{self.path / RUN_STATE} is damaged; resume from another checkpoint") from None


def _fallback_advice(checkpoint: Path) -> str:
    """What to do when `checkpoint` cannot be used: the checkpoint before it, if its folder has one."""
    step = checkpoint_step(checkpoint)
    earlier = [p for p in RunDir(checkpoint.parent.parent).list_checkpoints()
               if step is not None and checkpoint_step(p) < step]
    return (f"resume from the checkpoint before it with --resume {earlier[-1]}" if earlier
            else "no earlier checkpoint exists: start a new run in another --out_dir")


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a checkpoint file; a one-line error naming the file and the way out."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"checkpoint file {path} is missing or damaged ({err.__class__.__name__}); "
                        f"{_fallback_advice(path.parent)}") from None
    if not isinstance(value, dict):
        raise UserError(f"checkpoint file {path} is damaged (not a JSON object); {_fallback_advice(path.parent)}")
    return value


def find_resume_point(resume: str | None, out_dir: str | Path) -> ResumePoint | None:
    """The checkpoint `--resume` names: `latest` is the newest of `out_dir` (None when there is none yet),
    a path is that checkpoint, or the newest of that run folder.

    Never lets a run write over another: a new run (no `--resume`) is refused in a folder that holds
    checkpoints, a final model or the metrics of a run killed before its first checkpoint; `--resume latest`
    is refused on a finished run whose checkpoints were deleted; a checkpoint from elsewhere is refused
    into a folder that holds a run. An older checkpoint of `out_dir` itself is allowed: its newer ones are
    listed in `superseded`, to be set aside (not deleted) when the run starts."""
    run = RunDir(out_dir)
    newest = run.latest_checkpoint()
    if resume is None or (resume == "latest" and newest is None):
        if newest is not None:
            raise UserError(f"{run.path} already holds a run; pass --resume latest to continue it or choose another "
                            "--out_dir")
        if run.final.exists():
            raise UserError(f"{run.path} holds a finished run (final/) and no checkpoint to resume; choose another "
                            "--out_dir for a new run")
        if resume is None and run.metrics_file.exists():
            raise UserError(f"{run.path} holds the metrics of a run that saved no checkpoint; pass --resume latest "
                            "to start that run over, or choose another --out_dir")
        return None
    path = newest if resume == "latest" else Path(resume)
    if resume != "latest" and not (path / RUN_STATE).is_file():
        path = RunDir(path).latest_checkpoint()  # a run folder: its newest checkpoint
        if path is None:
            raise UserError(f"--resume {resume} is not a checkpoint (no {RUN_STATE}); pass 'latest' or a "
                            "checkpoints/step_* folder")
    superseded: tuple[Path, ...] = ()
    if path.resolve().parent == run.checkpoints.resolve():
        step = checkpoint_step(path)
        superseded = tuple(p for p in run.list_checkpoints() if checkpoint_step(p) > step)
    elif newest is not None or run.final.exists():
        raise UserError(f"{run.path} holds another run; resume {path} into a new --out_dir (two histories would mix)")
    return ResumePoint(path, _read_json(path / GPT_CONFIG), _read_json(path / RUN_STATE), superseded)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(folder: Path) -> None:
    """Record the size and sha256 of every file in `folder` (the last file written into a checkpoint)."""
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"version": 1, "files": files}, indent=1))


def _required_files(point: ResumePoint) -> list[str]:
    """What a resume reads: our state files (and the manifest, for checkpoints that have one), every saved
    rank's RNG and data state, the model and the optimizer (files, or folders of FSDP's sharded state)."""
    world = int(point.run_state.get("world_size", 1))
    names = [GPT_CONFIG, RUN_STATE] + ([MANIFEST] if point.run_state.get("format", 1) >= FORMAT else [])
    for rank in range(world):
        names += [data_state_file(rank), f"random_states_{rank}.pkl"]
    if (point.path / ADAPTER_CONFIG).is_file():  # a LoRA run's: the adapter in place of the model
        return names + [ADAPTER_CONFIG, ADAPTER_WEIGHTS, "optimizer.bin"]
    sharded = (point.path / "pytorch_model_fsdp_0").is_dir()
    # accelerate names its optimizers' files optimizer.bin, optimizer_1.bin, ... (--optimizer muon has two).
    optimizers = ["optimizer.bin"] + [f"optimizer_{i}.bin" for i in range(1, int(point.run_state.get("optimizers", 1)))]
    return names + (["pytorch_model_fsdp_0", "optimizer_0"] if sharded else ["model.safetensors", *optimizers])


def verify_checkpoint(point: ResumePoint) -> None:
    """Check that everything `load_checkpoint` will read is present and unchanged since it was saved.

    Checkpoints written before manifests existed are checked for the presence of every file and readable RNG
    states only."""
    advice = _fallback_advice(point.path)
    for name in _required_files(point):
        if not (point.path / name).exists():
            raise UserError(f"checkpoint {point.path} is incomplete: {name} is missing; {advice}")
    if (point.path / MANIFEST).is_file():
        _check_against_manifest(point.path, advice)
    # accelerate swallows a failed RNG load (it logs at info level and goes on: a silently inexact resume),
    # so read the RNG states here first, the way it will: weights_only, which never runs pickled code.
    for rank in range(int(point.run_state.get("world_size", 1))):
        file = point.path / f"random_states_{rank}.pkl"
        try:
            accelerate_load(file)
        except Exception as err:  # noqa: BLE001 - any failure to unpickle is a damaged file here
            raise UserError(f"checkpoint file {file} cannot be read ({type(err).__name__}); {advice}") from None


def _check_against_manifest(folder: Path, advice: str) -> None:
    files = _read_json(folder / MANIFEST).get("files")
    if not isinstance(files, dict) or not all(isinstance(e, dict) and {"bytes", "sha256"} <= e.keys()
                                              for e in files.values()):
        raise UserError(f"{folder / MANIFEST} is damaged; {advice}")
    for name, entry in files.items():
        file = folder / name
        if not file.is_file():
            raise UserError(f"checkpoint {folder} is incomplete: {name} is missing; {advice}")
        if file.stat().st_size != entry["bytes"]:
            raise UserError(f"checkpoint file {file} was cut short or overwritten ({file.stat().st_size} bytes, "
                            f"{entry['bytes']} when saved); {advice}")
        if _sha256(file) != entry["sha256"]:
            raise UserError(f"checkpoint file {file} is damaged (its sha256 differs from the one saved); {advice}")


def set_aside_superseded(point: ResumePoint, run: RunDir) -> Path | None:
    """Move the checkpoints newer than `point` (and final/, and a copy of metrics.jsonl) to
    `superseded/<time>-after-<step>/`, so the run goes on from `point` with one history; nothing is deleted.
    Main process, with the run folder locked. Returns the folder, or None when nothing was newer."""
    if not point.superseded:
        return None
    aside = run.superseded / f"{time.strftime('%Y%m%d-%H%M%S')}-after-{point.path.name}"
    aside.mkdir(parents=True)
    for checkpoint in point.superseded:
        checkpoint.rename(aside / checkpoint.name)
    for final in (run.final, run.final_adapter):
        if final.exists():
            final.rename(aside / final.name)
    if run.metrics_file.exists():
        shutil.copy2(run.metrics_file, aside / run.metrics_file.name)
    return aside


def _quiet_tied_weight_warning(record: logging.LogRecord) -> bool:
    # save_state drops the tied lm_head.weight (it is wte.weight) and warns at every save; the model
    # re-ties it when loading, so the warning is noise.
    return "Removed shared tensor" not in record.getMessage()


def save_checkpoint(
    accelerator: Accelerator,
    run: RunDir,
    progress: Progress,
    data_state: dict[str, Any],
    gpt_config: Any,
    keep_last: int,
) -> Path:
    """Save everything needed to resume after optimizer step `progress.step`; call on every rank.
    Returns the published checkpoint folder."""
    final = run.checkpoint(progress.step)
    tmp = temp_path(final)
    if accelerator.is_main_process:
        fresh_temp_dir(final)
    accelerator.wait_for_everyone()

    logging.getLogger("accelerate.utils.other").addFilter(_quiet_tied_weight_warning)  # once: filters are a set
    with _disk_errors_as_user_errors(tmp, final):
        accelerator.save_state(str(tmp))
        (tmp / data_state_file(accelerator.process_index)).write_text(json.dumps(data_state, indent=2))
    accelerator.wait_for_everyone()  # every rank's files are in tmp

    if accelerator.is_main_process:
        with _disk_errors_as_user_errors(tmp, final):
            (tmp / GPT_CONFIG).write_text(json.dumps(asdict(gpt_config), indent=2))
            run_state = {**asdict(progress), "world_size": accelerator.num_processes, "format": FORMAT,
                         "optimizers": len(accelerator._optimizers)}
            (tmp / RUN_STATE).write_text(json.dumps(run_state, indent=2))
            _write_manifest(tmp)
            publish(tmp, final)  # replaces a same-step checkpoint of an earlier attempt
        # Everything older than the kept ones goes, also a folder a crash left half-deleted (no longer complete).
        oldest_kept = checkpoint_step(run.list_checkpoints()[-keep_last:][0])  # the one just published, at least
        for old in run.checkpoints.iterdir():
            if (step := checkpoint_step(old)) is not None and step < oldest_kept:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


@contextmanager
def _disk_errors_as_user_errors(tmp: Path, final: Path) -> Iterator[None]:
    """A full disk or a folder that became unwritable while saving: remove the partial checkpoint and say so in
    one line (the published checkpoints are untouched: a save only ever renames a finished folder into place).
    Under several processes only the rank that failed knows; the others stop at their next collective."""
    try:
        yield
    except (OSError, SafetensorError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
        raise UserError(f"could not write checkpoint {final.name} in {final.parent} ({reason}); the earlier "
                        "checkpoints are intact: free disk space (or fix the folder) and continue with --resume "
                        "latest") from None


def load_checkpoint(accelerator: Accelerator, point: ResumePoint, gpt_config: Any) -> dict[str, Any]:
    """Restore accelerate's state from `point`; return this rank's data-loader state."""
    current = asdict(gpt_config)
    diffs = [f"{k}: checkpoint {point.gpt_config.get(k)!r} vs now {v!r}" for k, v in current.items()
             if point.gpt_config.get(k) != v]
    if diffs:
        raise UserError(f"{point.path} was trained with another model config ({'; '.join(diffs)}); use the same "
                        "model flags to resume")
    saved_optimizers = int(point.run_state.get("optimizers", 1))
    if saved_optimizers != len(accelerator._optimizers):
        kinds = {1: "--optimizer adamw", 2: "--optimizer muon"}
        saved = kinds.get(saved_optimizers, f"{saved_optimizers} optimizers")
        raise UserError(f"{point.path} was trained with {saved}, "
                        f"this run has {kinds.get(len(accelerator._optimizers), 'another')}; resume with the optimizer "
                        "it was saved with")
    own = point.path / data_state_file(accelerator.process_index)
    # The strided loaders keep one global cursor, so rank 0's state serves a new rank after a world-size change;
    # loaders that cannot follow such a change refuse it in their load_state_dict.
    data_state = _read_json(own if own.is_file() else point.path / data_state_file(0))
    saved_world = int(point.run_state.get("world_size", accelerator.num_processes))
    if saved_world != accelerator.num_processes:
        accelerator.print(f"note: {point.path.name} was saved by {saved_world} process(es), this run has "
                          f"{accelerator.num_processes}: data order and weights go on exactly, per-rank random streams "
                          "(dropout) start afresh")
    try:
        accelerator.load_state(str(point.path))
    except (OSError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as err:
        # verify_checkpoint found every file intact: what is left is a checkpoint of another kind of run
        # (e.g. another optimizer or parameter layout) or a file changed since.
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise UserError(f"cannot load checkpoint {point.path} ({type(err).__name__}: {first[:200]}); resume it with "
                        "the settings it was saved with, or from another checkpoint") from None
    # load_state restores accelerate's micro-step counter, which decides when `accumulate` syncs. Checkpoints
    # sit on optimizer-step boundaries, so the right count is 0: a restored count with another accumulation
    # (after a change of world size or micro-batch) would put every sync mid-window and silently stop updates.
    accelerator.step = 0
    return data_state


class Checkpointer:
    """Saves a run's checkpoints, and never one whose weights no longer compute a finite loss (so the
    newest checkpoint is always one a resume can continue from, and rotation never removes the last good one)."""

    def __init__(self, accelerator: Accelerator, run: RunDir, gpt_config: Any, keep_last: int,
                 healthy: Callable[[torch.nn.Module], bool]) -> None:
        self.accelerator, self.run, self.gpt_config, self.keep_last = accelerator, run, gpt_config, keep_last
        self.healthy = healthy

    def save(self, model: torch.nn.Module, progress: Progress, data_state: dict[str, Any]) -> Path:
        """Check the weights (on every rank: `healthy` may run collectives), then `save_checkpoint`; returns the
        checkpoint folder."""
        if not self.healthy(model):
            raise UserError(f"the weights after step {progress.step} give a non-finite loss, so they were not saved; "
                            f"last good checkpoint: {self.run.latest_checkpoint()}. Lower --lr (or lengthen "
                            "--warmup_steps) and resume from it", on_every_rank=True)
        return save_checkpoint(self.accelerator, self.run, progress, data_state, self.gpt_config, self.keep_last)
