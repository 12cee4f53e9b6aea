"""Training checkpoints: accelerate's `save_state` plus the loop's own state, written atomically, and loaded back.

A checkpoint is `<out_dir>/checkpoints/step_000100/` (layout in `common.run_dir`) holding accelerate's
files (model, one file per optimizer, per-rank RNG and accumulation step), `gpt_config.json`,
`run_state.json` (step, tokens seen, tracker run id, world size, the optimizers by name), one
`data_state_rank{r}.json` per rank and, written last, `manifest.json` (`common.manifest`). Everything is
first written to `.tmp-step_000100/` and renamed into place only once every rank has finished
(`common.atomic`), so a crash in the middle of a save leaves a temp folder that `RunDir.latest_checkpoint`
never picks (it is cleared by the next save). Which checkpoint to resume is `training.checkpoints.resume`'s decision.
"""
from __future__ import annotations

import json
import logging
import pickle
import shutil
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, load_fsdp_optimizer, save_fsdp_optimizer
from safetensors import SafetensorError

from common.atomic import fresh_temp_dir, rename_into_place, temp_path, write_failure
from common.errors import UserError
from common.manifest import FORMAT, write_manifest
from common.run_dir import ADAPTER_WEIGHTS, GPT_CONFIG, RUN_STATE, RunDir, checkpoint_step, data_state_file
from configs import RunConfig
from model import GPTConfig
from model.lora import adapter_state, has_adapters, load_adapter_state, save_adapter_config
from model.unwrap import unwrapped
from training.checkpoints.ddp_files import load_into_stage, save_from_stages
from training.checkpoints.moving import Move, load_moved
from training.checkpoints.resume import Progress, ResumePoint, read_json
from training.distributed.engines import Engine
from training.distributed.pipeline import PipelinedGPT
from training.distributed.prepare import outside_accelerate


def _quiet_tied_weight_warning(record: logging.LogRecord) -> bool:
    # save_state drops the tied lm_head.weight (it is wte.weight) and warns at every save; the model
    # re-ties it when loading, so the warning is noise.
    return "Removed shared tensor" not in record.getMessage()


def use_adapter_checkpoints(accelerator: Accelerator, lora: bool) -> None:
    """For a LoRA run (`lora`), make `save_state`/`load_state` save and load a model with adapters as its adapter
    only (`adapter_model.safetensors`, `adapter_config.json`: `model.lora`), not its frozen base; optimizer, RNG
    and data states are saved as for any run, and the manifest covers every file. Nothing for any other run."""
    if not lora:
        return

    def adapted(model: torch.nn.Module) -> torch.nn.Module | None:
        module = unwrapped(model)
        return module if has_adapters(module) else None

    def save_adapters_only(models: list, weights: list, output_dir: str) -> None:
        # accelerate saves weights[i] as model(_i).safetensors: a model whose entry is removed is saved here instead.
        from safetensors.torch import save_file

        for i in reversed(range(len(models))):
            if (module := adapted(models[i])) is not None:
                if accelerator.is_main_process:
                    save_file(adapter_state(module), Path(output_dir) / ADAPTER_WEIGHTS, metadata={"format": "pt"})
                    save_adapter_config(module, Path(output_dir))
                weights.pop(i)

    def load_adapters(models: list, input_dir: str) -> None:
        # accelerate loads every model left in `models` from model(_i).safetensors: this one is loaded here.
        from safetensors.torch import load_file

        for model in list(models):
            if (module := adapted(model)) is not None:
                load_adapter_state(module, load_file(Path(input_dir) / ADAPTER_WEIGHTS), input_dir)
                models.remove(model)

    accelerator.register_save_state_pre_hook(save_adapters_only)
    accelerator.register_load_state_pre_hook(load_adapters)


def save_checkpoint(
    accelerator: Accelerator,
    run: RunDir,
    progress: Progress,
    data_state: dict[str, Any],
    gpt_config: GPTConfig,
    optimizers: tuple[str, ...],
    keep_last: int,
    engine: Engine,
    model: torch.nn.Module | None = None,
    trained: list[torch.optim.Optimizer] = (),
) -> Path:
    """Save everything needed to resume after optimizer step `progress.step`; call on every rank.
    `optimizers`: the names of the prepared optimizers, in order; `engine`: the one that runs (recorded, with its
    tensor-parallel and pipeline degrees); `model`: a pipeline's stage (`PipelinedGPT`) writes the whole model's
    files itself (accelerate prepares neither it nor its optimizers); `trained`: the run's optimizers, of which those
    kept out of accelerate under FSDP2 (`training.distributed.prepare`) are saved here. Returns the published
    checkpoint folder."""
    final = run.checkpoint(progress.step)
    tmp = temp_path(final)
    if accelerator.is_main_process:
        fresh_temp_dir(final)
    accelerator.wait_for_everyone()

    logging.getLogger("accelerate.utils.other").addFilter(_quiet_tied_weight_warning)  # once: filters are a set
    with _disk_errors_as_user_errors(run, tmp, final):
        accelerator.save_state(str(tmp))
        if isinstance(model, PipelinedGPT):
            save_from_stages(model, tmp)  # the files a DDP run writes, gathered from the stages
        for index, optimizer in _fsdp_outside(accelerator, trained):  # beside accelerate's optimizer_0/
            save_fsdp_optimizer(accelerator.state.fsdp_plugin, accelerator, optimizer, model, str(tmp), index)
        index, writes = _data_state_index(accelerator, model)
        if writes:
            (tmp / data_state_file(index)).write_text(json.dumps(data_state, indent=2))
    accelerator.wait_for_everyone()  # every rank's files are in tmp

    if accelerator.is_main_process:
        with _disk_errors_as_user_errors(run, tmp, final):
            (tmp / GPT_CONFIG).write_text(json.dumps(asdict(gpt_config), indent=2))
            run_state = {**asdict(progress), "world_size": accelerator.num_processes, "format": FORMAT,
                         "optimizers": list(optimizers), "engine": engine.as_record()}
            if isinstance(model, PipelinedGPT):  # one data state per pipeline (they are a DDP run's files)
                run_state["data_ranks"] = model.pipeline.replicas
            (tmp / RUN_STATE).write_text(json.dumps(run_state, indent=2))
            write_manifest(tmp)
            rename_into_place(tmp, final)  # replaces a same-step checkpoint of an earlier attempt
        # Everything older than the kept ones goes, also a folder a crash left half-deleted (no longer complete).
        oldest_kept = checkpoint_step(run.list_checkpoints()[-keep_last:][0])  # the one just published, at least
        for old in run.checkpoints.iterdir():
            if (step := checkpoint_step(old)) is not None and step < oldest_kept:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


@contextmanager
def _disk_errors_as_user_errors(run: RunDir, tmp: Path, final: Path) -> Iterator[None]:
    """A full disk or a folder that became unwritable while saving `run`'s checkpoint `final`: remove the partial
    checkpoint and say so in one line (the published checkpoints are untouched: a save only ever renames a finished
    folder into place), and what there is to continue from. Under several processes only the rank that failed
    knows; the others stop at their next collective."""
    try:
        yield
    except (OSError, SafetensorError, RuntimeError) as err:
        if (reason := write_failure(err)) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        kept = ("the earlier checkpoints are intact: free disk space (or fix the folder) and continue with --resume "
                "latest" if run.list_checkpoints() else
                "the run has no checkpoint yet (this was its first): free disk space (or fix the folder) and start it "
                "again with --resume latest")
        raise UserError(f"could not write checkpoint {final.name} in {final.parent} ({reason}); {kept}") from None


def _data_state_index(accelerator: Accelerator, model: torch.nn.Module | None) -> tuple[int, bool]:
    """Which data_state_rank{i}.json is this rank's, and whether it writes it: its process index; in a pipeline, its
    data-parallel rank, written by the first stage (the stages read the same batches), so that the files are those
    of a DDP run of as many processes as there are pipelines."""
    if isinstance(model, PipelinedGPT):
        return model.pipeline.replica, model.pipeline.first
    return accelerator.process_index, True


def _fsdp_outside(accelerator: Accelerator, trained: list) -> list[tuple[int, torch.optim.Optimizer]]:
    """The optimizers accelerate does not save under FSDP2 (`training.distributed.prepare`), with their index."""
    return outside_accelerate(list(trained)) if accelerator.distributed_type == DistributedType.FSDP else []


def load_checkpoint(accelerator: Accelerator, point: ResumePoint, gpt_config: GPTConfig,
                    optimizers: tuple[str, ...], model: torch.nn.Module | None = None,
                    trained: list[torch.optim.Optimizer] = (), move: Move | None = None) -> dict[str, Any]:
    """Restore accelerate's state from `point` into the prepared model and `optimizers` (their names, in order),
    or a pipeline's stage (`model`) from the whole model's files; under `move` (another engine's checkpoint), the
    checkpoint read whole into the prepared `model` and optimizers (`trained`); return this rank's data-loader
    state."""
    current = asdict(gpt_config)
    diffs = [f"{k}: checkpoint {point.gpt_config.get(k)!r} vs now {v!r}" for k, v in current.items()
             if point.gpt_config.get(k) != v]
    if diffs:
        raise UserError(f"{point.path} was trained with another model config ({'; '.join(diffs)}); use the same "
                        "model flags to resume")
    if point.optimizers != optimizers:
        saved, now = (f"--optimizer {names[-1]}" for names in (point.optimizers, optimizers))
        raise UserError(f"{point.path} was trained with {saved}, this run has {now}; resume with the optimizer "
                        "it was saved with")
    own = point.path / data_state_file(_data_state_index(accelerator, model)[0])
    # The strided loaders keep one global cursor, so rank 0's state serves a new rank after a world-size change;
    # loaders that cannot follow such a change refuse it in their load_state_dict.
    data_state = read_json(own if own.is_file() else point.path / data_state_file(0))
    saved_world = point.world_size
    if move is not None:
        accelerator.print(move.announcement(point.path))
    elif saved_world != accelerator.num_processes:
        accelerator.print(f"note: {point.path.name} was saved by {saved_world} process(es), this run has "
                          f"{accelerator.num_processes}: data order and weights go on exactly, per-rank random streams "
                          "(dropout) start afresh")
    try:
        if move is not None:  # another engine's format: read whole, each rank takes its piece (moving.py)
            load_moved(point, move, gpt_config, model, list(trained), accelerator)
        else:
            accelerator.load_state(str(point.path))
            if isinstance(model, PipelinedGPT):
                load_into_stage(model, point.path)
            for index, optimizer in _fsdp_outside(accelerator, trained):
                load_fsdp_optimizer(accelerator.state.fsdp_plugin, accelerator, optimizer, model, str(point.path),
                                    index)
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

    def __init__(self, accelerator: Accelerator, run: RunDir, gpt_config: GPTConfig, optimizers: tuple[str, ...],
                 keep_last: int, healthy: Callable[[torch.nn.Module], bool], engine: Engine,
                 trained: list[torch.optim.Optimizer] = ()) -> None:
        self.accelerator, self.run, self.gpt_config, self.keep_last = accelerator, run, gpt_config, keep_last
        self.optimizers, self.healthy, self.engine, self.trained = optimizers, healthy, engine, list(trained)

    def save(self, model: torch.nn.Module, progress: Progress, data_state: dict[str, Any]) -> Path:
        """Check the weights (on every rank: `healthy` may run collectives), then `save_checkpoint`; returns the
        checkpoint folder."""
        if not self.healthy(model):
            raise UserError(f"the weights after step {progress.step} give a non-finite loss, so they were not saved; "
                            f"last good checkpoint: {self.run.latest_checkpoint()}. Lower --lr (or lengthen "
                            "--warmup_steps) and resume from it", on_every_rank=True)
        return save_checkpoint(self.accelerator, self.run, progress, data_state, self.gpt_config, self.optimizers,
                               self.keep_last, self.engine, model, self.trained)


def restore(accelerator: Accelerator, resume: ResumePoint | None, cfg: RunConfig, gpt_config: GPTConfig,
            optimizers: tuple[str, ...], loader: Any, model: torch.nn.Module | None = None,
            trained: list[torch.optim.Optimizer] = (), move: Move | None = None,
            max_steps: int | None = None) -> Progress:
    """Load the resume point into the prepared model and optimizers, the RNGs and the data loader; the run's
    progress (a new run's when there is nothing to resume). A resume point at `max_steps` is a finished run's, and
    the line says so (a requeued job, a `--resume latest` run again): nothing is trained."""
    if resume is None:
        if cfg.resume:
            accelerator.print(f"no checkpoint in {cfg.out_dir} yet: starting a new run")
        return Progress()
    loader.load_state_dict(load_checkpoint(accelerator, resume, gpt_config, optimizers, model, trained, move))
    progress = resume.progress
    accelerator.print(f"resumed from {resume.path} at step {progress.step} ({progress.tokens:,} tokens)")
    if progress.step == max_steps:
        accelerator.print(f"the run had already finished: step {progress.step} is its --max_steps, so nothing is "
                          "trained; final/ is written again from the same weights (pass a larger --max_steps to train "
                          "on)")
    return progress
