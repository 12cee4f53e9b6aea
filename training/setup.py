"""Starting a run: processes and devices, the model (new, pretrained or resumed) and the run folder."""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, ProjectConfiguration
from filelock import FileLock, Timeout

from common.errors import UserError, when_done
from common.run_dir import RunDir
from configs import TrainConfig, write_run_config
from model import GPT, GPTConfig
from training.checkpoint import (
    Progress,
    ResumePoint,
    find_resume_point,
    load_checkpoint,
    set_aside_superseded,
    verify_checkpoint,
)
from training.lora import add_run_adapters, check_resume, use_adapter_checkpoints
from training.metrics import MetricsLog, trackers_for
from training.optim import describe_optimizers, refuse_unsupported
from training.step import accumulation_steps


def start_accelerator(cfg: TrainConfig) -> tuple[Accelerator, int]:
    """The Accelerator of this process (devices, precision, compile and FSDP from accelerate's config) and the
    number of micro-steps per optimizer step."""
    # A multi-process launch on a machine without CUDA runs on gloo; otherwise every process would be rank 0.
    cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    state = PartialState(cpu=cpu)  # knows the world size before the Accelerator needs the accumulation count
    # A process that stops on an error with its gloo group open aborts now and then at exit (SIGABRT instead of
    # status 2): close the group whenever the entry point ends (a no-op after end_training closed it).
    when_done(_close_process_group)
    grad_accum = accumulation_steps(cfg, state.num_processes)
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=grad_accum, log_with=trackers_for(cfg.report_to),
                              project_config=ProjectConfiguration(cfg.out_dir,
                                                                  logging_dir=str(RunDir(cfg.out_dir).tensorboard)))
    refuse_unsupported(cfg, sharded=accelerator.distributed_type == DistributedType.FSDP)
    if accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if cfg.lora_rank:
        use_adapter_checkpoints(accelerator)  # checkpoints hold the adapters, not the frozen base
    return accelerator, grad_accum


def _close_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def build_model(cfg: TrainConfig, resume: ResumePoint | None) -> GPT:
    """The network this run trains: from the flags (`init_from scratch`), from `init_from` weights, or, for a
    fine-tune being resumed, the checkpoint's architecture (its weights replace init_from's when loaded).

    The architecture fields of `cfg` are then set to the network's, so that the run's config.yaml and its
    trackers record the model that ran, not the flags' unused defaults (`n_layer: 4` for a 2-layer model).
    With `--lora_rank`, the network gets adapters and only they train (see `training.lora`)."""
    if resume is not None:
        check_resume(cfg, resume.path)  # a LoRA checkpoint only into the same LoRA run, a full one only into a full run
    model = _network(cfg, resume)
    if cfg.lora_rank:
        model = add_run_adapters(model, cfg)
    arch = model.config
    cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.bias = arch.n_layer, arch.n_head, arch.n_embd, arch.bias
    cfg.block_size = arch.block_size
    return model


def _network(cfg: TrainConfig, resume: ResumePoint | None) -> GPT:
    if cfg.init_from == "scratch":
        return GPT(GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
                             dropout=cfg.dropout, bias=cfg.bias))
    if resume is not None and not cfg.lora_rank:  # a LoRA checkpoint holds no base weights: init_from has them
        try:
            arch = GPTConfig(**{**resume.gpt_config, "block_size": cfg.block_size, "dropout": cfg.dropout})
        except (TypeError, ValueError) as err:
            raise UserError(f"the model config in {resume.path} is damaged ({err}); resume from another "
                            "checkpoint") from None
        return GPT(arch)
    return GPT.from_pretrained(cfg.init_from, block_size=cfg.block_size, dropout=cfg.dropout)


def claim_run_folder(accelerator: Accelerator, cfg: TrainConfig, resume: ResumePoint | None) -> None:
    """Make `--out_dir` this run's own, once `find_resume_point` accepted it (so a refused run created nothing).

    The main process takes the folder's lock (one run per folder; the OS drops the lock of a process that
    died, `run_cli` the lock of an entry point that ended), sees that the folder still resumes the same way,
    and checks the resume point file by file. Call inside `same_outcome_on_every_rank`."""
    run = RunDir(cfg.out_dir)
    if resume is not None and resume.progress.step > cfg.max_steps:
        raise UserError(f"{resume.path} is at step {resume.progress.step}, past --max_steps {cfg.max_steps}; "
                        "pass a larger --max_steps to train on")
    if not accelerator.is_main_process:
        return
    run.path.mkdir(parents=True, exist_ok=True)
    lock = _lock(run.lock_file)
    try:
        now = find_resume_point(cfg.resume, run.path)
        if (now and (now.path, now.superseded)) != (resume and (resume.path, resume.superseded)):
            raise UserError(f"another run changed {run.path} while this one was starting; start this one again")
        if resume is not None:
            verify_checkpoint(resume)
    except UserError:
        lock.release()
        raise


def _lock(path: Path) -> FileLock:
    """Take the lock at `path` (released when the entry point ends, see `common.errors.when_done`), or say
    which run holds it."""
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise UserError(f"another run is writing into {path.parent} (it holds {path}); wait for it to end or "
                        "choose another --out_dir") from None
    when_done(lock.release)
    return lock


def restore(accelerator: Accelerator, cfg: TrainConfig, resume: ResumePoint | None, arch: GPTConfig,
            train_loader: Any) -> Progress:
    """Load the resume point into the prepared model and optimizer, the RNGs and the loader; the run's progress."""
    if resume is None:
        if cfg.resume:
            accelerator.print(f"no checkpoint in {cfg.out_dir} yet: starting a new run")
        return Progress()
    train_loader.load_state_dict(load_checkpoint(accelerator, resume, arch))
    progress = resume.progress
    accelerator.print(f"resumed from {resume.path} at step {progress.step} ({progress.tokens:,} tokens)")
    return progress


def open_run_folder(accelerator: Accelerator, cfg: TrainConfig, progress: Progress,
                    resume: ResumePoint | None) -> MetricsLog:
    """Set aside what an older resume point supersedes, record the config and start the trackers (once the
    resume was accepted and loaded, so that a refused one leaves the folder untouched); the run's metrics log."""
    run = RunDir(cfg.out_dir)
    if accelerator.is_main_process:
        aside = set_aside_superseded(resume, run) if resume is not None else None
        if aside is not None:
            newer = ", ".join(p.name for p in resume.superseded)
            print(f"resuming from {resume.path.name}: the newer checkpoints ({newer}) and final/, if any, were moved "
                  f"to {aside} (with a copy of metrics.jsonl); nothing was deleted", flush=True)
        write_run_config(cfg, run.config_file)
    accelerator.init_trackers(cfg.wandb_project, config=asdict(cfg),
                              init_kwargs={"wandb": {"id": progress.run_id, "resume": "allow",
                                                     "name": cfg.run_name or run.path.name, "dir": str(run.path)}})
    return MetricsLog(accelerator, run.path, resume_step=progress.step)


def describe_run(accelerator: Accelerator, cfg: TrainConfig, model: torch.nn.Module, n_params: int,
                 grad_accum: int) -> str:
    """The run's header: model size, batch geometry, distribution, precision, compilation, device; then which
    optimizer trains which parameters."""
    # accelerate wraps the prepared model in torch.compile's OptimizedModule when a dynamo backend is set.
    compiled = f"torch.compile ({accelerator.state.dynamo_plugin.backend.value.lower()})" \
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else "eager"
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    lora = (f" (LoRA r={cfg.lora_rank} on {cfg.lora_targets}: {trainable:,} trainable, "
            f"{trainable / sum(p.numel() for p in params):.2%} of all)" if cfg.lora_rank else "")
    return (f"GPT {n_params / 1e6:.2f}M params{lora} | {accelerator.num_processes} process(es) x {grad_accum} "
            f"accumulation x {cfg.micro_batch_size} x {cfg.block_size} = {cfg.total_batch_size:,} tokens per step | "
            f"distributed: {accelerator.distributed_type.value} | precision: {accelerator.mixed_precision} | "
            f"{compiled} | {accelerator.device}\n"
            f"{describe_optimizers(accelerator.unwrap_model(model, keep_torch_compile=False), cfg)}")
