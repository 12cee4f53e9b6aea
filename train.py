"""Train a GPT on Accelerate: the same script on a laptop CPU, one GPU, 8xH100 or several nodes.

    python train.py                                   # small GPT on Tiny Shakespeare, CPU-friendly
    accelerate launch --config_file accelerate_configs/8gpu.yaml train.py \
        --config configs/gpt2_124m_fineweb_edu.yaml   # GPT-2 124M on FineWeb-Edu 10B

Precision (bf16), torch.compile (dynamo backend), the number of processes and FSDP come from the
accelerate config; everything about the run comes from `configs.TrainConfig` (preset + flags).
This file is the story of a run; the machinery lives in `training/` (see docs/architecture.md).
"""
from __future__ import annotations

import gc

import torch
from accelerate.utils import set_seed

from common.console import TerminalBar
from common.errors import alike_on_every_rank, run_cli
from common.run_dir import RunDir
from configs import parse_config
from data.source import open_source
from publish.card import write_card
from publish.uploads import HubUploads
from training.checkpoint import Checkpointer, find_resume_point
from training.evaluation import TrainingEvals
from training.export import export_final
from training.metrics import StepLine, Throughput
from training.mfu import estimate_mfu, peak_flops
from training.optim import build_optimizer, scheduled_lrs
from training.preemption import PreemptionFlag
from training.preflight import check_out_dir_writable, checkpoint_bytes, warn_if_low_disk
from training.ranks import same_outcome_on_every_rank
from training.setup import build_model, claim_run_folder, describe_run, open_run_folder, restore, start_accelerator
from training.step import NonFinitePolicy, learning_rate, train_step


def main() -> None:
    # Setup: whatever can refuse the run does so before anything is written, once, on every rank alike.
    with alike_on_every_rank():
        cfg = parse_config()
        accelerator, grad_accum = start_accelerator(cfg)
    run, rank, world = RunDir(cfg.out_dir), accelerator.process_index, accelerator.num_processes
    with same_outcome_on_every_rank(accelerator):
        resume = find_resume_point(cfg.resume, run.path)  # never over another run's files
        uploads = HubUploads(cfg, accelerator.is_main_process)  # a missing Hub token fails now, not after training
        set_seed(cfg.seed)  # identical initial weights on every rank
        model = build_model(cfg, resume)
        # Data: every rank reads its own rows of the same global batches; validation is one fixed token set.
        source = open_source(cfg)  # --dataset, parsed once
        train_loader = source.train_loader(block_size=cfg.block_size, micro_batch_size=cfg.micro_batch_size,
                                           rank=rank, world_size=world, seed=cfg.seed)
        evals = TrainingEvals(cfg, source, accelerator)
        check_out_dir_writable(run.path)
        claim_run_folder(accelerator, cfg, resume)  # one run per folder (locked); the checkpoint checked file by file
    arch, n_params, flops_per_token = model.config, model.num_params(), model.flops_per_token()
    if accelerator.is_main_process:
        warn_if_low_disk(run.path, checkpoint_bytes(n_params), cfg.keep_last)
    optimizers = build_optimizer(model, cfg, accelerator.device.type)  # [AdamW] or [AdamW, Muon]
    model, *optimizers = accelerator.prepare(model, *optimizers)  # no scheduler: the LR is computed from the step
    torch.manual_seed(cfg.seed + rank)  # from here on, each rank draws its own dropout masks
    progress = restore(accelerator, cfg, resume, arch, train_loader)  # weights, optimizer, RNGs, data position
    metrics = open_run_folder(accelerator, cfg, progress, resume)
    checkpoints = Checkpointer(accelerator, run, arch, cfg.keep_last, healthy=evals.finite_loss)
    nan_policy = NonFinitePolicy(cfg, run, accelerator)
    preempted, throughput = PreemptionFlag(), Throughput(cfg.total_batch_size)
    peak = peak_flops(accelerator.device, cfg.mfu_peak_flops)
    accelerator.print(describe_run(accelerator, cfg, model, n_params, grad_accum))

    # The loop: one optimizer step, then whatever is due after it (log, evals, checkpoint, a signal). Each log
    # step and evaluation is a plain line; the live bar is drawn only on a terminal.
    model.train()
    step_line = StepLine(cfg.max_steps, progress.step)
    with TerminalBar(total=cfg.max_steps, initial=progress.step, show=accelerator.is_main_process, unit="step",
                     dynamic_ncols=True) as bar:  # closed (its line ended) also when an error stops the run
        while progress.step < cfg.max_steps:
            with throughput.timing():
                lr = learning_rate(cfg, progress.step)
                loss_sum, grad_norm = train_step(accelerator, model, optimizers, train_loader.next_batch, grad_accum,
                                                 scheduled_lrs(cfg, lr), cfg.grad_clip,
                                                 masked_targets=train_loader.masked_targets)
            nan_policy.after_step(progress.step + 1, grad_norm)
            progress.step += 1
            progress.tokens += cfg.total_batch_size
            bar.update(1)
            last = progress.step == cfg.max_steps

            record = {}
            if progress.step % cfg.log_every == 0 or last:
                loss = accelerator.reduce(loss_sum / grad_accum, reduction="mean").item()
                tok_per_sec = throughput.read()
                record = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": progress.tokens,
                          "tok_per_sec": tok_per_sec, "mfu": estimate_mfu(flops_per_token, tok_per_sec, world, peak)}
                if accelerator.is_main_process:
                    bar.write(step_line.format(progress.step, record))
            record.update(evals.run_due(model, progress.step, last, write=bar.write))
            if record:
                metrics.log(progress.step, record)
            stop = preempted.any_rank(accelerator)
            if progress.step % cfg.save_every == 0 or last or stop:
                uploads.checkpoint_saved(progress.step, checkpoints.save(model, progress, train_loader.state_dict()))
            if stop:
                accelerator.print(f"signal received: checkpoint saved at step {progress.step}; "
                                  "continue with --resume latest")
                break

    # Shutdown: the final export, then an orderly end (two gloo processes that exit with live tensors and an
    # open group abort now and then), then the final push, after the process group is gone so that no rank
    # sits in a collective timeout during the upload.
    finished = progress.step == cfg.max_steps
    if finished:
        export_final(accelerator, model, arch, run)
        if accelerator.is_main_process:  # final/ gets the card and curves the Hub push would upload
            write_card(run.path, hub_model_id=cfg.hub_model_id if cfg.push_to_hub else None)
    accelerator.wait_for_everyone()
    del model, optimizers
    gc.collect()
    accelerator.end_training()
    uploads.wait()
    if finished:
        uploads.push_final()


if __name__ == "__main__":
    run_cli(main)
