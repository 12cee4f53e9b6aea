"""Which checkpoint a run continues from, and what it may never do to a run folder (the resume policy).

`--resume latest` is the newest complete checkpoint of `--out_dir`; a path is that checkpoint, or the newest of that
run folder. A new run never writes over another. A checkpoint from elsewhere never resumes into a folder that holds
a run. An older checkpoint of the folder itself may, and its newer ones are set aside in `superseded/`, never
deleted. Before a resume loads anything, `verify_checkpoint` checks its files (`checkpoint_io.manifest`): a damaged
checkpoint is one line naming the file and the earlier checkpoint to resume from, never a traceback or a silently
inexact resume. `training.checkpoints.checkpoint` loads them.
"""
from __future__ import annotations

import json
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoint_io.manifest import resume_problem
from common.errors import UserError
from common.run_dir import FSDP_MODEL_DIR, GPT_CONFIG, RUN_STATE, RunDir, checkpoint_step

# Older checkpoints recorded only how many optimizers they held, which meant these (in accelerate's file order).
_OPTIMIZERS_BY_COUNT = {1: ("adamw",), 2: ("adamw", "muon")}


@dataclass
class Progress:
    """Where a run stands: optimizer steps done, tokens consumed, and the trackers' run id."""

    step: int = 0
    tokens: int = 0
    run_id: str = field(default_factory=lambda: secrets.token_hex(4))

    def advance(self, tokens: int) -> None:
        """One more optimizer step, of `tokens` tokens."""
        self.step += 1
        self.tokens += tokens


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint chosen for resumption, with the small files that the run's setup needs."""

    path: Path
    gpt_config: dict[str, Any]  # as saved: `asdict(GPTConfig)`
    run_state: dict[str, Any]  # step, tokens, run_id, world_size
    superseded: tuple[Path, ...] = ()  # newer checkpoints of the run folder, set aside when the run starts

    @property
    def optimizers(self) -> tuple[str, ...]:
        """The optimizers whose state the checkpoint holds, e.g. ("adamw", "muon")."""
        saved = self.run_state.get("optimizers", 1)
        if isinstance(saved, list) and all(isinstance(name, str) for name in saved):
            return tuple(saved)
        if isinstance(saved, int) and saved in _OPTIMIZERS_BY_COUNT:
            return _OPTIMIZERS_BY_COUNT[saved]
        raise UserError(f"{self.path / RUN_STATE} is damaged (optimizers: {saved!r}); resume from another checkpoint")

    @property
    def run(self) -> RunDir | None:
        """The run folder the checkpoint belongs to (None for one elsewhere)."""
        return RunDir.holding(self.path)

    @property
    def world_size(self) -> int:
        return int(self.run_state.get("world_size", 1))

    @property
    def data_ranks(self) -> int:
        """How many data_state_rank{i}.json files it holds: one per process, or per pipeline."""
        return int(self.run_state.get("data_ranks", self.world_size))

    @property
    def engine(self) -> dict[str, Any]:
        """The engine that wrote the checkpoint (`Parallelism.as_record`). Older ones are recognised by their files."""
        saved = self.run_state.get("engine")
        if isinstance(saved, dict) and isinstance(saved.get("kind"), str):
            return saved
        return {"kind": "fsdp" if (self.path / FSDP_MODEL_DIR).is_dir() else "ddp", "zero_stage": 0}

    @property
    def progress(self) -> Progress:
        try:
            return Progress(int(self.run_state["step"]), int(self.run_state["tokens"]), str(self.run_state["run_id"]))
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{self.path / RUN_STATE} is damaged; resume from another checkpoint") from None


def fallback_advice(checkpoint: Path) -> str:
    """What to do when `checkpoint` cannot be used: the checkpoint before it, if its folder has one."""
    step, run = checkpoint_step(checkpoint), RunDir.holding(checkpoint)
    in_run = step is not None and run is not None
    earlier = [p for p in run.list_checkpoints() if checkpoint_step(p) < step] if in_run else []
    return (f"resume from the checkpoint before it with --resume {earlier[-1]}" if earlier
            else "no earlier checkpoint exists: start a new run in another --out_dir")


def verify_checkpoint(point: ResumePoint) -> None:
    """Check that everything `load_checkpoint` will read is present and unchanged since it was saved."""
    problem = resume_problem(point.path, point.run_state.get("format", 1), point.world_size, point.data_ranks,
                             len(point.optimizers))
    if problem is not None:
        raise UserError(f"{problem}; {fallback_advice(point.path)}")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a checkpoint file; a one-line error naming the file and the way out."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"checkpoint file {path} is missing or damaged ({err.__class__.__name__}); "
                        f"{fallback_advice(path.parent)}") from None
    if not isinstance(value, dict):
        raise UserError(f"checkpoint file {path} is damaged (not a JSON object); {fallback_advice(path.parent)}")
    return value


def find_resume_point(resume: str | None, out_dir: str | Path) -> ResumePoint | None:
    """The checkpoint `--resume` names: `latest` is the newest of `out_dir` (None when there is none yet), a path is
    that checkpoint or the newest of that run folder.

    Never lets a run write over another. A new run is refused in a folder that holds checkpoints, a final model or
    a killed run's metrics. `--resume latest` is refused on a finished run without checkpoints. A checkpoint from
    elsewhere is refused into a folder that holds a run. An older checkpoint of `out_dir` itself is allowed; its
    newer ones are listed in `superseded`, to be set aside when the run starts."""
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
    return ResumePoint(path, read_json(path / GPT_CONFIG), read_json(path / RUN_STATE), superseded)


def set_aside_superseded(point: ResumePoint, run: RunDir) -> Path | None:
    """Move the checkpoints newer than `point`, final/ and a copy of metrics.jsonl to `superseded/<time>-after-<step>/`,
    so the run goes on with one history and nothing is deleted. Call on the main process, with the folder locked.
    Returns the folder, or None when nothing was newer."""
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


