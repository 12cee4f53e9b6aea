"""Train a GPT on Accelerate: the same script on a laptop CPU, one GPU, 8xH100 or several nodes.

    python train.py                                   # small GPT on Tiny Shakespeare, CPU-friendly
    accelerate launch --config_file accelerate_configs/8gpu.yaml train.py \
        --config configs/gpt2_124m_fineweb_edu.yaml   # GPT-2 124M on FineWeb-Edu 10B

Precision (bf16), torch.compile (dynamo backend), the number of processes and FSDP come from the
accelerate config; everything about the run comes from `configs` (preset + flags), one group of
fields per component. This file is the story of a run; the machinery lives in `training/` (see
docs/architecture.md).
"""
from __future__ import annotations

import gc
import sys
from contextlib import ExitStack
from functools import partial

import torch
from accelerate.utils import set_seed

from common.console import TerminalBar
from common.errors import computed_alike_on_every_rank, run_cli
from common.run_dir import RunDir
from configs import parse_config
from data.source import open_source
from planner import exit_after_plan
from publish.card import write_card
from publish.uploads import HubUploads
from training.checkpoint import Checkpointer, restore, use_adapter_checkpoints
from training.draw import draw_step
from training.elastic import Attempt, open_process_group
from training.engines import fit_deepspeed, refuse_unsupported
from training.evaluation import TrainingEvals
from training.export import export_final
from training.layout import Layout
from training.machine import Asked, Machine, runs_here
from training.metrics import StepReport, run_header, trackers_for
from training.moving import checkpoint_move
from training.network import build_model
from training.optim import build_optimizer, plan_optimizers, release_optimizer_state
from training.pipeline import pipelined
from training.preemption import PreemptionFlag
from training.preflight import checkpoint_bytes
from training.prepare import prepare
from training.processes import (
    BatchGeometry,
    close_process_group,
    shared_across_ranks,
    start_accelerator,
)
from training.recipe import resume_recipe
from training.resume import find_resume_point
from training.run_folder import (
    claim_run_folder,
    open_run_folder,
    recorded_config,
    refuse_while_another_run_writes,
)
from training.step import LRSchedule, NonFinitePolicy, train_step
from training.tensor_parallel import evaluation_ranks, split
from training.timing import CHECKPOINT, DATA, EVAL, STEP, RunClock


def main() -> None:
    clock = RunClock()  # where the run's time goes: the step, waiting for data, evaluations, checkpoints, the rest
    with ExitStack() as on_exit:  # what the run holds (its process group, its folder's lock) is let go at its end
        on_exit.callback(close_process_group)
        # Setup: whatever can refuse the run does so before anything is written, once, on every rank alike.
        with computed_alike_on_every_rank():
            cfg = exit_after_plan(parse_config())  # --plan: print the memory plan and stop here
            run, max_steps = RunDir(cfg.run.out_dir), cfg.training.max_steps
            # The process group, its waits bounded: a peer that dies or hangs ends the run in one line.
            peers = on_exit.enter_context(open_process_group(cfg.run.collective_timeout, run.latest_checkpoint))
            plan = plan_optimizers(cfg.optim, cfg.model)  # what trains with what, at which learning rate
            layout = Layout.of_launch(cfg.training.tensor_parallel,  # processes, engine, groups that split matrices
                                      *((cfg.model.n_head, cfg.model.n_embd) if cfg.model.from_scratch else ()),
                                      pipeline_parallel=cfg.training.pipeline_parallel,  # and pipelines' stages
                                      n_layer=cfg.model.n_layer if cfg.model.from_scratch else None)
            geometry = BatchGeometry.of_launch(cfg.training, cfg.model.block_size,  # of the batch, in tokens; its
                                               layout.data_parallel_size)  # world: the ranks reading other batches
            trackers = trackers_for(cfg.log.report_to)  # an extra's tracker not installed: one line
        accelerator = start_accelerator(geometry.accumulation, trackers, run)
        ranks = evaluation_ranks(layout, accelerator)  # the data-parallel ranks (the accelerator without TP)
        data_rank = layout.data_parallel_rank(accelerator.process_index)  # a TP group reads one stream of batches
        with shared_across_ranks(accelerator):
            layout = layout.running(accelerator)  # DeepSpeed's ZeRO stage as its plugin runs it
            engine = layout.engine  # DDP, FSDP2 or DeepSpeed ZeRO-n: the accelerate config's; x TP
            refuse_unsupported(engine, accelerator, plan.kind, bool(cfg.model.lora_rank), cfg.training.on_nan,
                               cfg.training.activation_checkpointing)  # what we do not run under it, in one line
            refuse_while_another_run_writes(run, accelerator.is_main_process)  # first: no advice helps then
            resume = find_resume_point(cfg.run.resume, run.path)  # never over another run's files
            move = checkpoint_move(resume, engine, accelerator.num_processes, plan)  # saved by another engine?
            uploads = HubUploads(cfg.hub, run, cfg.run.save_every, accelerator.is_main_process)  # token checked now
            set_seed(cfg.training.seed)  # identical initial weights on every rank
            model, init_weights = build_model(cfg.model, resume, cfg.training.activation_checkpointing,
                                              cfg.training.loss_chunk_rows)  # the loss's path (None: the device's)
            layout.check_model(model.config.n_head, model.config.n_embd)  # --init_from's heads, too
            use_adapter_checkpoints(accelerator, bool(cfg.model.lora_rank))  # LoRA: adapters only, not the base
            # Data: every rank reads its own rows of the same global batches; validation is one fixed token set.
            source = open_source(cfg.data)  # --dataset, parsed once
            loader = source.train_loader(block_size=geometry.block_size, micro_batch_size=geometry.micro_batch_size,
                                         rank=data_rank, world_size=geometry.world_size,
                                         seed=cfg.training.seed)
            on_exit.callback(loader.close)  # a stream read ahead: its thread stopped, its files closed
            evals = TrainingEvals(cfg.eval, source, geometry.block_size, cfg.training.seed, ranks)
            arch, n_params, flops_per_token = model.config, model.num_params(False), model.flops_per_token()  # all
            fit_deepspeed(accelerator, geometry.micro_batch_size, geometry.accumulation, cfg.training.grad_clip,
                          arch.n_embd)  # DeepSpeed's config gets this run's batch and clipping (other engines: no-op)
            record = recorded_config(cfg, arch, plan, source.pinned, init_weights)  # Hub data, weights at commits
            recipe = resume_recipe(record, resume, plan, move)  # what a resume may not change is refused here
            on_exit.enter_context(claim_run_folder(accelerator, cfg.run, resume, max_steps,
                                                   checkpoint_bytes(n_params)))  # one run per folder, locked
        model = split(model, layout, accelerator)  # --tensor_parallel: the blocks split, FSDP2 across the groups
        model = pipelined(model, layout, geometry.accumulation, geometry.micro_batch_size,  # --pipeline_parallel:
                          accelerator)  # this rank's stage, its micro-batches the step's accumulation
        optimizers = build_optimizer(model, plan, accelerator.device.type)  # [AdamW] or [AdamW, Muon]
        model, *optimizers = prepare(accelerator, model, optimizers, plan)  # no scheduler: the LR is from the step
        torch.manual_seed(cfg.training.seed + data_rank)  # each data-parallel rank its own dropout masks from here
        progress = restore(accelerator, resume, cfg.run, arch, plan.names, loader, model,  # weights, optimizers,
                           optimizers, move)  # RNGs, the data position (from another engine's format: moved)
        peers.follow(progress)
        metrics = open_run_folder(accelerator, run, resume, progress, recipe, cfg.log.wandb_project, cfg.log.run_name)
        checkpoints = Checkpointer(accelerator, run, arch, plan.names, cfg.run.keep_last, healthy=evals.finite_loss,
                                   engine=engine, trained=optimizers)
        nan_policy = NonFinitePolicy(cfg.training.on_nan, cfg.training.max_nan_skips, run, accelerator)
        schedule = LRSchedule(cfg.optim.warmup_steps, max_steps, cfg.optim.min_lr_ratio)
        report = StepReport(cfg.log, accelerator, max_steps, progress.step, geometry.tokens_per_step, flops_per_token,
                            clock)
        accelerator.print(run_header(accelerator, engine, model, n_params, geometry, plan, cfg.model.lora_summary,
                                     source.describe(), Attempt.of_launch().describe(),
                                     runs_here(Asked.of_environment(), Machine.this())))  # a GPU config on a CPU
        if accelerator.is_main_process and (warning := schedule.warmup_warning()):
            print(f"warning: {warning}", file=sys.stderr, flush=True)  # the run goes on (a smoke run, say)
        # The loop: one optimizer step, then what is due after it (log line, evals, checkpoint, a signal's stop).
        model.train()  # dropout on: pretrained weights are loaded in eval mode, as for inference
        preempted = PreemptionFlag(announce=accelerator.is_main_process)  # SIGTERM, SIGUSR1, the first Ctrl-C
        with TerminalBar(total=max_steps, initial=progress.step, show=accelerator.is_main_process, unit="step",
                         dynamic_ncols=True) as bar:  # closed (its line ended) also when an error stops the run
            while progress.step < max_steps:
                with report.timing():
                    lrs = plan.lrs_at(schedule.factor(progress.step))
                    with clock.phase(DATA):  # all ranks stop if one cannot read its data
                        batches = draw_step(accelerator, loader, geometry.accumulation, progress,
                                            save=partial(checkpoints.save, model, progress))
                    with clock.phase(STEP):
                        loss_sum, grad_norm = train_step(accelerator, model, optimizers, iter(batches).__next__,
                                                         geometry.accumulation, lrs, cfg.training.grad_clip,
                                                         masked_targets=loader.masked_targets)
                nan_policy.after_step(progress.step + 1, grad_norm)
                progress.advance(geometry.tokens_per_step)
                bar.update(1)
                last = progress.step == max_steps
                record = report.of_step(progress.step, last, loss_sum / geometry.accumulation, lrs[0], grad_norm,
                                        progress.tokens, write=bar.write)
                with clock.phase(EVAL) as evaluating:
                    evaluated = evals.run_due(model, progress.step, last, write=bar.write)
                if evaluated:
                    record.update(evaluated, eval_s=round(evaluating.seconds, 4))
                stop = preempted.any_rank(accelerator)
                if progress.step % cfg.run.save_every == 0 or last or stop:
                    with clock.phase(CHECKPOINT) as saving:
                        saved = checkpoints.save(model, progress, loader.state_dict())
                    uploads.checkpoint_saved(progress.step, saved)
                    record["checkpoint_s"] = round(saving.seconds, 4)
                metrics.log(progress.step, record)  # the step's line, its evaluations and save (or nothing)
                if stop:
                    accelerator.print(preempted.stopped_at(progress.step))
                    break

        # Shutdown: final/, an orderly end (gloo processes exiting with live tensors and an open group abort now and
        # then), then the final push once the group is gone (no rank waits in a collective during the upload).
        if finished := progress.step == max_steps:
            release_optimizer_state(optimizers)  # in the last checkpoint: the export gets the memory
            export_final(accelerator, model, arch, run, metrics.last_val, init_weights,  # and what to run next
                         tensor_parallel=layout.tensor_parallel, hellaswag_data=cfg.eval.hellaswag_data)
            if accelerator.is_main_process:  # final/ gets the card and curves the Hub push would upload
                write_card(run.path, hub_model_id=cfg.hub.hub_model_id if cfg.hub.push_to_hub else None)
        accelerator.print(clock.summary())  # this process's wall time: step, data, evaluation, checkpoint, other
        accelerator.wait_for_everyone()
        del model, optimizers
        gc.collect()
        accelerator.end_training()
    uploads.wait()
    if finished:
        uploads.push_final()


if __name__ == "__main__":
    run_cli(main)
