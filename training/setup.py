"""Starting a run: processes and devices, the model (new, pretrained or resumed) and the run folder."""
from __future__ import annotations

import os
from dataclasses import asdict

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import ProjectConfiguration

from common.errors import UserError
from common.run_dir import RunDir
from configs import TrainConfig, write_run_config
from model import GPT, GPTConfig
from training.checkpoint import Progress, ResumePoint
from training.metrics import MetricsLog, trackers_for
from training.step import accumulation_steps


def start_accelerator(cfg: TrainConfig) -> tuple[Accelerator, int]:
    """The Accelerator of this process (devices, precision, compile and FSDP from accelerate's config) and the
    number of micro-steps per optimizer step."""
    # A multi-process launch on a machine without CUDA runs on gloo; otherwise every process would be rank 0.
    cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    state = PartialState(cpu=cpu)  # knows the world size before the Accelerator needs the accumulation count
    grad_accum = accumulation_steps(cfg, state.num_processes)
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=grad_accum, log_with=trackers_for(cfg.report_to),
                              project_config=ProjectConfiguration(cfg.out_dir,
                                                                  logging_dir=str(RunDir(cfg.out_dir).tensorboard)))
    if accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return accelerator, grad_accum


def build_model(cfg: TrainConfig, resume: ResumePoint | None) -> GPT:
    """The network this run trains: from the flags (`init_from scratch`), from `init_from` weights, or, for a
    fine-tune being resumed, the checkpoint's architecture (its weights replace init_from's when loaded)."""
    if cfg.init_from == "scratch":
        return GPT(GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
                             dropout=cfg.dropout, bias=cfg.bias))
    if resume is not None:
        try:
            arch = GPTConfig(**{**resume.gpt_config, "block_size": cfg.block_size, "dropout": cfg.dropout})
        except (TypeError, ValueError) as err:
            raise UserError(f"the model config in {resume.path} is damaged ({err}); resume from another checkpoint") from None
        return GPT(arch)
    return GPT.from_pretrained(cfg.init_from, block_size=cfg.block_size, dropout=cfg.dropout)


def open_run_folder(accelerator: Accelerator, cfg: TrainConfig, progress: Progress) -> MetricsLog:
    """Record the config and start the trackers; only once a resume was accepted, so that a refused one
    leaves the run folder untouched. Returns the run's metrics log."""
    run = RunDir(cfg.out_dir)
    if accelerator.is_main_process:
        run.path.mkdir(parents=True, exist_ok=True)
        write_run_config(cfg, run.config_file)
    accelerator.init_trackers(cfg.wandb_project, config=asdict(cfg),
                              init_kwargs={"wandb": {"id": progress.run_id, "resume": "allow",
                                                     "name": cfg.run_name or run.path.name, "dir": str(run.path)}})
    return MetricsLog(accelerator, run.path, resume_step=progress.step)


def describe_run(accelerator: Accelerator, cfg: TrainConfig, n_params: int, grad_accum: int) -> str:
    """The run's header line: model size, batch geometry, distribution, precision, device."""
    return (f"GPT {n_params / 1e6:.2f}M params | {accelerator.num_processes} process(es) x {grad_accum} accumulation x "
            f"{cfg.micro_batch_size} x {cfg.block_size} = {cfg.total_batch_size:,} tokens per step | distributed: "
            f"{accelerator.distributed_type.value} | precision: {accelerator.mixed_precision} | {accelerator.device}")
