"""Training checkpoints: accelerate's `save_state` plus the loop's own state, published atomically.

A checkpoint is `<out_dir>/checkpoints/step_000100/` (layout in `common.run_dir`) holding
accelerate's files (model, optimizer, per-rank RNG and accumulation step), `gpt_config.json`,
`run_state.json` (step, tokens seen, tracker run id, world size) and one `data_state_rank{r}.json`
per rank. Everything is first written to `.tmp-step_000100/` and renamed into place only once every
rank has finished (`common.atomic.publish`), so a crash in the middle of a save leaves a temp folder
that `RunDir.latest_checkpoint` never picks (it is cleared by the next save).
"""
from __future__ import annotations

import json
import logging
import secrets
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from common.atomic import fresh_temp_dir, publish, temp_path
from common.errors import UserError
from common.run_dir import GPT_CONFIG, RUN_STATE, RunDir, checkpoint_step, data_state_file


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

    @property
    def progress(self) -> Progress:
        try:
            return Progress(int(self.run_state["step"]), int(self.run_state["tokens"]), str(self.run_state["run_id"]))
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{self.path / RUN_STATE} is damaged; resume from another checkpoint") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is missing or damaged ({err.__class__.__name__}); resume from another checkpoint "
                        "(--resume <run>/checkpoints/step_N)") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} is damaged (not a JSON object); resume from another checkpoint")
    return value


def find_resume_point(resume: str | None, out_dir: str | Path) -> ResumePoint | None:
    """The checkpoint `--resume` names: `latest` is the newest of `out_dir` (None when there is none yet),
    a path is that checkpoint, or the newest of that run folder.

    Never lets a run write over another: a new run (no `--resume`) is refused in a folder that holds
    checkpoints, a final model or the metrics of a run killed before its first checkpoint; `--resume latest`
    is refused on a finished run whose checkpoints were deleted; an older checkpoint of `out_dir` is
    refused while newer ones exist there (two histories would mix in one folder)."""
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
    if not (path / RUN_STATE).is_file():
        path = RunDir(path).latest_checkpoint()  # a run folder: its newest checkpoint
        if path is None:
            raise UserError(f"--resume {resume} is not a checkpoint (no {RUN_STATE}); pass 'latest' or a "
                            "checkpoints/step_* folder")
    step = checkpoint_step(path)
    if newest is not None and step is not None and newest.resolve().parent == path.resolve().parent \
            and checkpoint_step(newest) > step:
        raise UserError(f"{out_dir} holds a newer checkpoint ({newest.name}) than {path.name}; move the newer "
                        "ones away to branch off an older step, or resume into another --out_dir")
    return ResumePoint(path, _read_json(path / GPT_CONFIG), _read_json(path / RUN_STATE))


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
    accelerator.save_state(str(tmp))
    (tmp / data_state_file(accelerator.process_index)).write_text(json.dumps(data_state, indent=2))
    accelerator.wait_for_everyone()  # every rank's files are in tmp

    if accelerator.is_main_process:
        (tmp / GPT_CONFIG).write_text(json.dumps(asdict(gpt_config), indent=2))
        (tmp / RUN_STATE).write_text(json.dumps({**asdict(progress), "world_size": accelerator.num_processes}, indent=2))
        publish(tmp, final)  # replaces a same-step checkpoint of an earlier attempt
        for old in run.list_checkpoints()[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, point: ResumePoint, gpt_config: Any) -> dict[str, Any]:
    """Restore accelerate's state from `point`; return this rank's data-loader state."""
    current = asdict(gpt_config)
    diffs = [f"{k}: checkpoint {point.gpt_config.get(k)!r} vs now {v!r}" for k, v in current.items()
             if point.gpt_config.get(k) != v]
    if diffs:
        raise UserError(f"{point.path} was trained with another model config ({'; '.join(diffs)}); use the same "
                        "model flags to resume")
    own = point.path / data_state_file(accelerator.process_index)
    # The strided loaders keep one global cursor, so rank 0's state serves a new rank after a world-size change;
    # loaders that cannot follow such a change refuse it in their load_state_dict.
    data_state = _read_json(own if own.is_file() else point.path / data_state_file(0))
    accelerator.load_state(str(point.path))
    # load_state restores accelerate's micro-step counter, which decides when `accumulate` syncs. Checkpoints
    # sit on optimizer-step boundaries, so the right count is 0: a restored count with another accumulation
    # (after a change of world size or micro-batch) would put every sync mid-window and silently stop updates.
    accelerator.step = 0
    return data_state
