"""The run folder (`--out_dir`) of a training run: claimed once the run is accepted, then recorded.

A refused run leaves the folder as it was: the folder is locked and written only after every check that can refuse
the run has passed. One run per folder: a `RunLock` holds the lock as long as the run lasts, and the OS drops it if
the process dies.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from accelerate import Accelerator
from filelock import FileLock, Timeout

from checkpoint_io.weights import Weights
from common.errors import UserError
from common.run_dir import RunDir
from configs import RunConfig, TrainConfig, write_run_config
from model import GPTConfig
from training.checkpoints.preflight import check_out_dir_writable, saves_ahead, warn_if_low_disk
from training.checkpoints.resume import (
    Progress,
    ResumePoint,
    find_resume_point,
    set_aside_superseded,
    verify_checkpoint,
)
from training.metrics import MetricsLog, tracker_run_name, trackers_in_plain_text
from training.optimizers.plan import OptimizerPlan
from training.recipe import Recipe


class RunLock:
    """`<out_dir>/.lock`, taken by `acquire` or refused naming the run that holds it. Let go when the context it is
    entered into ends."""

    def __init__(self, run: RunDir) -> None:
        self.path = run.lock_file
        self.lock = FileLock(self.path)
        self.created = False

    def acquire(self) -> RunLock:
        self.created = not self.path.exists()
        try:
            self.lock.acquire(timeout=0)
        except Timeout:
            raise UserError(f"another run is writing into {self.path.parent} (it holds {self.path}); wait for it to "
                            "end or choose another --out_dir") from None
        return self

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, exc_type: type[BaseException] | None = None, *exc: object) -> None:
        # A run that fails leaves no .lock it did not find. It is removed while still held; a run starting at that
        # instant fails to lock and is told to retry.
        if exc_type is not None and self.created:
            self.path.unlink(missing_ok=True)
        self.lock.release()


def refuse_while_another_run_writes(run: RunDir, is_main_process: bool) -> None:
    """Refuse a folder whose lock another process holds, before its contents are judged: no advice about them can
    work while that run writes. The main process probes an existing lock file only, so a refused run creates none.
    Call inside `training.distributed.processes.shared_across_ranks`, which gives the refusal to every rank."""
    if is_main_process and run.lock_file.exists():
        RunLock(run).acquire().__exit__(None)


def claim_run_folder(accelerator: Accelerator, cfg: RunConfig, resume: ResumePoint | None, max_steps: int,
                     checkpoint_size: int) -> AbstractContextManager:
    """Make the folder this run's own, once `find_resume_point` accepted it, and return the held lock to enter.

    The main process checks that the folder can be written, takes its lock, sees that the folder still resumes
    the same way, checks the resume point file by file and warns when the disk looks too small for the
    checkpoints of `checkpoint_size` bytes the run will hold (those it saves, at most `--keep_last`); it returns
    the held lock, to be entered into the run's context, which lets it go when the run ends (other processes: a
    context that holds nothing). Call inside `training.distributed.processes.shared_across_ranks`."""
    run = RunDir(cfg.out_dir)
    if resume is not None and resume.progress.step > max_steps:
        raise UserError(f"{resume.path} is at step {resume.progress.step}, past --max_steps {max_steps}; "
                        "pass a larger --max_steps to train on")
    check_out_dir_writable(run.path)
    if not accelerator.is_main_process:
        return nullcontext()
    run.path.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run).acquire()
    try:
        now = find_resume_point(cfg.resume, run.path)
        if (now and (now.path, now.superseded)) != (resume and (resume.path, resume.superseded)):
            raise UserError(f"another run changed {run.path} while this one was starting; start this one again")
        if resume is not None:
            verify_checkpoint(resume)
    except UserError as err:
        lock.__exit__(type(err))
        raise
    start = resume.progress.step if resume is not None else 0
    warn_if_low_disk(run.path, checkpoint_size, cfg.keep_last, saves_ahead(start, max_steps, cfg.save_every))
    return lock


def recorded_config(cfg: TrainConfig, arch: GPTConfig, plan: OptimizerPlan, dataset: str,
                    init_weights: Weights | None) -> dict[str, Any]:
    """What the run ran with, one key per flag, for config.yaml and the trackers. The architecture is the model's,
    `--optimizer auto` and `--lr` are resolved, and Hub data and weights are pinned to the commit read (`id@sha`), so
    the same command reads the same data and weights again."""
    values = cfg.flat()
    values["dataset"] = dataset
    if init_weights is not None and init_weights.commit:
        values["init_from"] = init_weights.pinned
    values.update(n_layer=arch.n_layer, n_head=arch.n_head, n_embd=arch.n_embd, bias=arch.bias,
                  block_size=arch.block_size, optimizer=plan.kind, lr=plan.lr)
    return values


def open_run_folder(accelerator: Accelerator, run: RunDir, resume: ResumePoint | None, progress: Progress,
                    recipe: Recipe, wandb_project: str, run_name: str | None) -> MetricsLog:
    """Set aside what an older resume point supersedes, announce this resume's changes, write config.yaml and start
    the trackers; return the metrics log. Call once the resume is loaded, so a refused one leaves the folder
    untouched."""
    if accelerator.is_main_process:
        aside = set_aside_superseded(resume, run) if resume is not None else None
        if aside is not None:
            newer = ", ".join(p.name for p in resume.superseded)
            print(f"resuming from {resume.path.name}: the newer checkpoints ({newer}) and final/, if any, were moved "
                  f"to {aside} (with a copy of metrics.jsonl); nothing was deleted", flush=True)
        for line in recipe.announcements:
            print(line, flush=True)
        write_run_config(recipe.config_yaml(), run.config_file)
    # TensorBoard hides the steps past the checkpoint that an earlier attempt logged (purge_step), so that the steps
    # this run logs again replace them: each step once, as in metrics.jsonl.
    # trackio (its runs in the SQLite of its own folder, $TRACKIO_DIR) continues its run as wandb does, by the run id.
    with trackers_in_plain_text():  # trackio's banner, without its colour codes in a log
        accelerator.init_trackers(wandb_project, config=recipe.tracker_values(),
                                  init_kwargs={"wandb": {"id": progress.run_id, "resume": "allow",
                                                         "name": run_name or run.path.name, "dir": str(run.path)},
                                               "trackio": {"name": tracker_run_name(run_name, run, progress.run_id),
                                                           "resume": "allow"},
                                               "tensorboard": {"purge_step": progress.step + 1} if progress.step
                                               else {}})
    return MetricsLog(accelerator, run.path, resume_step=progress.step)

