"""Training checkpoints: accelerate's `save_state` plus the loop's own state, written atomically, and loaded back.

A checkpoint is `<out_dir>/checkpoints/step_000100/` (layout in `common.run_dir`) holding accelerate's
files (model, one file per optimizer, per-rank RNG and accumulation step), `gpt_config.json`,
`run_state.json` (step, tokens seen, tracker run id, world size, the optimizers by name), one
`data_state_rank{r}.json` per rank and, written last, `manifest.json` (`checkpoint_io.manifest`). Everything is
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

from checkpoint_io import ddp_files
from checkpoint_io.manifest import FORMAT, write_manifest
from common.atomic import fresh_temp_dir, rename_into_place, temp_path, write_failure
from common.errors import UserError
from common.parallelism import Parallelism
from common.run_dir import ADAPTER_WEIGHTS, GPT_CONFIG, RUN_STATE, RunDir, checkpoint_step, data_state_file
from configs import RunConfig, read_run_config
from data.settings import DataMismatch
from model import GPTConfig
from model.config import TIED_OUTPUT
from model.lora import adapter_state, has_adapters, load_adapter_state, save_adapter_config
from model.unwrap import unwrapped
from training.checkpoints.moving import Move, load_moved, load_whole, read_whole, whole_groups
from training.checkpoints.resume import Progress, ResumePoint, read_json
from training.distributed.pipeline import PipelinedGPT
from training.distributed.prepare import outside_accelerate


def _quiet_tied_weight_warning(record: logging.LogRecord) -> bool:
    # save_state drops the tied lm_head.weight and warns at every save; loading re-ties it, so the warning is noise.
    return "Removed shared tensor" not in record.getMessage()


def use_adapter_checkpoints(accelerator: Accelerator, lora: bool) -> None:
    """For a LoRA run, make `save_state`/`load_state` save and load the adapter only (`model.lora`), not the frozen
    base. Optimizer, RNG and data states are saved as for any run. A no-op for other runs."""
    if not lora:
        return

    def adapted(model: torch.nn.Module) -> torch.nn.Module | None:
        module = unwrapped(model)
        return module if has_adapters(module) else None

    def save_adapters_only(models: list, weights: list, output_dir: str) -> None:
        # accelerate saves what is left in `weights`; the adapter is saved here instead.
        from safetensors.torch import save_file

        for i in reversed(range(len(models))):
            if (module := adapted(models[i])) is not None:
                if accelerator.is_main_process:
                    save_file(adapter_state(module), Path(output_dir) / ADAPTER_WEIGHTS, metadata={"format": "pt"})
                    save_adapter_config(module, Path(output_dir))
                weights.pop(i)

    def load_adapters(models: list, input_dir: str) -> None:
        # accelerate loads what is left in `models`; the adapter is loaded here instead.
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
    engine: Parallelism,
    model: torch.nn.Module | None = None,
    trained: list[torch.optim.Optimizer] = (),
) -> Path:
    """Save what a resume after step `progress.step` needs, and return the published folder. Call on every rank.

    `optimizers` names the prepared optimizers in order; `engine` is recorded with its degrees. A pipeline stage
    (`model`) writes the whole model's files itself, since accelerate prepares neither it nor its optimizers. Of
    `trained`, those kept out of accelerate under FSDP2 (`training.distributed.prepare`) are saved here."""
    final = run.checkpoint(progress.step)
    tmp = temp_path(final)
    if accelerator.is_main_process:
        fresh_temp_dir(final)
    accelerator.wait_for_everyone()

    logging.getLogger("accelerate.utils.other").addFilter(_quiet_tied_weight_warning)  # once: filters are a set
    with _disk_errors_as_user_errors(run, tmp, final):
        accelerator.save_state(str(tmp))
        if isinstance(model, PipelinedGPT):
            _save_from_stages(model, tmp)
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
        # Delete everything older than the kept ones, also a folder a crash left half-deleted.
        oldest_kept = checkpoint_step(run.list_checkpoints()[-keep_last:][0])  # the one just published, at least
        for old in run.checkpoints.iterdir():
            if (step := checkpoint_step(old)) is not None and step < oldest_kept:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def _save_from_stages(model: PipelinedGPT, folder: Path) -> None:
    """Write a pipeline's whole model and optimizer state, gathered from its stages, as a DDP run's files. Call on
    every rank; the main process writes."""
    gathered = model.gather_whole()
    if gathered is not None:
        weights, states, settings = gathered
        weights.pop(TIED_OUTPUT)  # tied: saved once
        ddp_files.write(folder, weights, states, whole_groups(model.config, model.plan), settings)


@contextmanager
def _disk_errors_as_user_errors(run: RunDir, tmp: Path, final: Path) -> Iterator[None]:
    """Turn a full disk or an unwritable folder during a save into one line, after removing the partial checkpoint.
    Published checkpoints are untouched, since a save only renames a finished folder into place. Under several
    processes only the failing rank knows; the others stop at their next collective."""
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
    """This rank's data_state_rank{i}.json, and whether it writes it. In a pipeline, i is the data-parallel rank and
    the first stage writes it (the stages read the same batches): the files of a DDP run with one process per
    pipeline."""
    if isinstance(model, PipelinedGPT):
        return model.pipeline.replica, model.pipeline.first
    return accelerator.process_index, True


def _fsdp_outside(accelerator: Accelerator, trained: list) -> list[tuple[int, torch.optim.Optimizer]]:
    """The optimizers accelerate does not save under FSDP2 (`training.distributed.prepare`), with their index."""
    return outside_accelerate(list(trained)) if accelerator.distributed_type == DistributedType.FSDP else []


def load_checkpoint(accelerator: Accelerator, point: ResumePoint, gpt_config: GPTConfig,
                    optimizers: tuple[str, ...], model: torch.nn.Module | None = None,
                    trained: list[torch.optim.Optimizer] = (), move: Move | None = None) -> dict[str, Any]:
    """Restore `point` into the prepared model and optimizers, and return this rank's data-loader state.

    A pipeline stage (`model`) reads its part of the whole model's files. Under `move` (another engine's checkpoint)
    the checkpoint is read whole into `model` and `trained`."""
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
    # The strided loaders keep one global cursor, so rank 0's state serves a rank added by a world-size change.
    # Loaders that cannot follow such a change refuse it in their load_state_dict.
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
            if isinstance(model, PipelinedGPT):  # a pipeline saves a DDP run's files: each stage takes its part
                load_whole(read_whole(point, gpt_config, model.plan, Parallelism()), model, [], point.path)
            for index, optimizer in _fsdp_outside(accelerator, trained):
                load_fsdp_optimizer(accelerator.state.fsdp_plugin, accelerator, optimizer, model, str(point.path),
                                    index)
    except (OSError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as err:
        # verify_checkpoint found every file intact, so this is another kind of run's checkpoint or a changed file.
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise UserError(f"cannot load checkpoint {point.path} ({type(err).__name__}: {first[:200]}); resume it with "
                        "the settings it was saved with, or from another checkpoint") from None
    # load_state restores accelerate's micro-step counter, which decides when `accumulate` syncs. Checkpoints sit on
    # optimizer-step boundaries, so the count is 0. A restored count under another accumulation (a new world size
    # or micro-batch) would put every sync mid-window and silently stop updates.
    accelerator.step = 0
    return data_state


class Checkpointer:
    """Saves a run's checkpoints, never one whose weights give a non-finite loss. So the newest checkpoint can always
    be resumed, and rotation never removes the last good one."""

    def __init__(self, accelerator: Accelerator, run: RunDir, gpt_config: GPTConfig, optimizers: tuple[str, ...],
                 keep_last: int, healthy: Callable[[torch.nn.Module], bool], engine: Parallelism,
                 trained: list[torch.optim.Optimizer] = ()) -> None:
        self.accelerator, self.run, self.gpt_config, self.keep_last = accelerator, run, gpt_config, keep_last
        self.optimizers, self.healthy, self.engine, self.trained = optimizers, healthy, engine, list(trained)

    def save(self, model: torch.nn.Module, progress: Progress, data_state: dict[str, Any]) -> Path:
        """Check the weights, then `save_checkpoint`. Call on every rank: `healthy` may run collectives."""
        if not self.healthy(model):
            raise UserError(f"the weights after step {progress.step} give a non-finite loss, so they were not saved; "
                            f"last good checkpoint: {self.run.latest_checkpoint()}. Lower --lr (or lengthen "
                            "--warmup_steps) and resume from it", on_every_rank=True)
        return save_checkpoint(self.accelerator, self.run, progress, data_state, self.gpt_config, self.optimizers,
                               self.keep_last, self.engine, model, self.trained)


def other_data(checkpoint: Path, dataset: str, detail: str) -> str:
    """The line for a resume whose `--dataset` is not the data `checkpoint` was trained on (`detail`: how it differs,
    the loader's `data.settings.DataMismatch`): the dataset the run recorded, and the two ways on."""
    recorded = read_run_config(RunDir(checkpoint.parent.parent).config_file).get("dataset")
    if recorded is None:
        return (f"{checkpoint} was trained on other data than --dataset {dataset} ({detail}); resume with the run's "
                f"own --dataset, or start a new run in another --out_dir with --init_from {checkpoint} to train its "
                f"weights on {dataset}")
    if recorded == dataset:
        return (f"{checkpoint} was trained on --dataset {dataset}, whose data changed since ({detail}); restore the "
                f"data, or start a new run in another --out_dir with --init_from {checkpoint} to train its weights on "
                "the data as it is now")
    return (f"{checkpoint} was trained on --dataset {recorded} and this resume reads {dataset} ({detail}); resume "
            f"with --dataset {recorded}, or start a new run in another --out_dir with --init_from {checkpoint} to "
            f"train its weights on {dataset}")


def restore(accelerator: Accelerator, resume: ResumePoint | None, cfg: RunConfig, gpt_config: GPTConfig,
            optimizers: tuple[str, ...], loader: Any, dataset: str, model: torch.nn.Module | None = None,
            trained: list[torch.optim.Optimizer] = (), move: Move | None = None,
            max_steps: int | None = None) -> Progress:
    """Load the resume point into the prepared model and optimizers, the RNGs and the data loader; the run's
    progress (a new run's when there is nothing to resume). A resume point at `max_steps` is a finished run's, and
    the line says so (a requeued job, a `--resume latest` run again): nothing is trained. A loader whose data is not
    the checkpoint's is one line naming the `dataset` the run recorded and this one (`other_data`)."""
    if resume is None:
        if cfg.resume:
            accelerator.print(f"no checkpoint in {cfg.out_dir} yet: starting a new run")
        return Progress()
    data_state = load_checkpoint(accelerator, resume, gpt_config, optimizers, model, trained, move)
    try:
        loader.load_state_dict(data_state)
    except DataMismatch as other:
        raise UserError(other_data(resume.path, dataset, other.detail)) from None
    progress = resume.progress
    accelerator.print(f"resumed from {resume.path} at step {progress.step} ({progress.tokens:,} tokens)")
    if progress.step == max_steps:
        final = ("written again from the same weights" if RunDir(cfg.out_dir).has_final() else
                 "written now (the run stopped before its export was whole)")
        accelerator.print(f"the run had already finished: step {progress.step} is its --max_steps, so nothing is "
                          f"trained; final/ is {final} (pass a larger --max_steps to train on)")
    return progress
