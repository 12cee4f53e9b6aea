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

from common.errors import computed_alike_on_every_rank, run_cli
from common.imports import imports_for_good
from configs import TrainConfig, parse_config
from training.evaluations import registry as _evaluations  # noqa: F401  the registered evaluations' and
from training.optimizers import registry  # noqa: F401  optimizers' own flags are train.py's too


def main() -> None:
    """`python train.py [preset] [flags]`: the flags, then the run. The flags are parsed before the machinery is
    imported (torch, accelerate, the engines: seconds), so `--help` and a mistyped flag answer at once; the
    registered optimizers' and evaluations' own flags are read from modules that do not import torch
    (docs/benchmarks.md)."""
    with computed_alike_on_every_rank():  # every rank parses the same flags: rank 0 alone says what is wrong
        cfg = parse_config()
    train(cfg)


def train(cfg: TrainConfig) -> None:
    """The run `cfg` asks for (or its memory plan, `--plan`), from setup to the final push."""
    # The machinery of a run, imported once its flags are known to be good (see main), and for good.
    with imports_for_good():
        import torch
        import torch._dynamo  # imported by the first optimizer anyway (add_param_group is dynamo-disabled)
        from accelerate.utils import set_seed

        from common.console import TerminalBar
        from common.run_dir import RunDir
        from data.source import open_source
        from planner import exit_after_plan
        from publish.card import write_card
        from publish.uploads import HubUploads
        from training.checkpoints.checkpoint import Checkpointer, restore, use_adapter_checkpoints
        from training.checkpoints.export import export_final
        from training.checkpoints.moving import checkpoint_move
        from training.checkpoints.preflight import checkpoint_bytes
        from training.checkpoints.resume import find_resume_point
        from training.distributed.elastic import Attempt, open_process_group
        from training.distributed.engines import fit_deepspeed, refuse_unsupported
        from training.distributed.layout import Layout
        from training.distributed.machine import Asked, Machine, runs_here
        from training.distributed.pipeline import pipelined
        from training.distributed.prepare import prepare
        from training.distributed.processes import (
            BatchGeometry,
            close_process_group,
            shared_across_ranks,
            start_accelerator,
        )
        from training.distributed.tensor_parallel import evaluation_ranks, split
        from training.draw import draw_step
        from training.evaluations.runner import TrainingEvals
        from training.metrics import StepReport, run_header, trackers_for
        from training.network import build_model
        from training.optimizers.plan import build_optimizer, plan_optimizers, release_optimizer_state
        from training.preemption import PreemptionFlag, what_was_kept
        from training.recipe import resume_recipe
        from training.run_folder import (
            claim_run_folder,
            open_run_folder,
            recorded_config,
            refuse_while_another_run_writes,
        )
        from training.step import LRSchedule, NonFinitePolicy, train_step
        from training.timing import CHECKPOINT, DATA, EVAL, STEP, RunClock

    clock = RunClock()
    # The run's process group and its folder's lock are let go when the run ends, however it ends.
    with ExitStack() as on_exit:
        on_exit.callback(close_process_group)

        # Setup. Whatever can refuse the run does so here, on every rank alike, before anything is written.
        with computed_alike_on_every_rank():
            cfg = exit_after_plan(cfg)
            run, max_steps = RunDir(cfg.run.out_dir), cfg.training.max_steps
            # A peer that dies or hangs ends the run in one line, not a silent wait.
            peers = on_exit.enter_context(open_process_group(cfg.run.collective_timeout, run.latest_checkpoint))
            plan = plan_optimizers(cfg.optim, cfg.model, cfg.added)
            # The shapes are known from the flags when training from scratch; --init_from's are checked once loaded.
            shapes = (cfg.model.n_head, cfg.model.n_embd) if cfg.model.from_scratch else ()
            layout = Layout.of_launch(cfg.parallelism, *shapes,
                                      n_layer=cfg.model.n_layer if cfg.model.from_scratch else None)
            geometry = BatchGeometry.of_launch(cfg.training, cfg.model.block_size, layout.data_parallel_size)
            trackers = trackers_for(cfg.log.report_to)
        accelerator = start_accelerator(geometry.accumulation, trackers, run)
        ranks = evaluation_ranks(layout, accelerator)
        data_rank = layout.data_parallel_rank(accelerator.process_index)

        # From here a rank may fail alone (a file it reads), so the ranks agree on errors before going on.
        with shared_across_ranks(accelerator):
            layout = layout.running(accelerator)
            parallelism = layout.parallelism
            refuse_unsupported(parallelism, accelerator, plan.kind, bool(cfg.model.lora_rank), cfg.training.on_nan,
                               cfg.training.activation_checkpointing, cfg.training.grad_clip)
            refuse_while_another_run_writes(run, accelerator.is_main_process)
            resume = find_resume_point(cfg.run.resume, run.path)
            move = checkpoint_move(resume, parallelism, accelerator.num_processes, plan)
            uploads = HubUploads(cfg.hub, run, cfg.run.save_every, accelerator.is_main_process)
            source = open_source(cfg.data)  # data that is not there is said before any weights are fetched
            # Identical initial weights on every rank.
            set_seed(cfg.training.seed)
            model, init_weights = build_model(cfg.model, resume, cfg.training.activation_checkpointing,
                                              cfg.training.loss_chunk_rows)
            layout.check_model(model.config.n_head, model.config.n_embd)
            use_adapter_checkpoints(accelerator, bool(cfg.model.lora_rank))

            # Data: every rank reads its own rows of the same global batches; validation is one fixed token set.
            # Every id of the data must be one the model knows (a small-vocabulary --init_from, shards of others).
            source.check_vocab(model.config.vocab_size, f"--init_from {cfg.model.init_from}" if init_weights else
                               "the model")
            loader = source.train_loader(block_size=geometry.block_size, micro_batch_size=geometry.micro_batch_size,
                                         rank=data_rank, world_size=geometry.world_size, seed=cfg.training.seed)
            on_exit.callback(loader.close)
            evals = TrainingEvals(cfg.eval, cfg.added, source, geometry.block_size, cfg.training.seed, ranks)

            arch, n_params, flops_per_token = model.config, model.num_params(False), model.flops_per_token()
            fit_deepspeed(accelerator, geometry.micro_batch_size, geometry.accumulation, cfg.training.grad_clip,
                          arch.n_embd, muon=plan.spec.zero_build is not None)
            # What the run records, and what a resume may not change, is settled before the folder is claimed.
            record = recorded_config(cfg, arch, plan, source.pinned, init_weights)
            recipe = resume_recipe(record, resume, plan, move)
            on_exit.enter_context(claim_run_folder(accelerator, cfg.run, resume, max_steps,
                                                   checkpoint_bytes(n_params)))

        # The model as this launch holds it: split, staged, prepared; then the state it resumes from.
        model = split(model, layout, accelerator)
        model = pipelined(model, layout, geometry.accumulation, geometry.micro_batch_size, accelerator)
        optimizers = build_optimizer(model, plan, accelerator.device.type, one_client=layout.one_client_optimizer)
        model, *optimizers = prepare(accelerator, model, optimizers, plan)
        # Each data-parallel rank draws its own dropout masks from here on.
        torch.manual_seed(cfg.training.seed + data_rank)
        progress = restore(accelerator, resume, cfg.run, arch, plan.names, loader, cfg.data.dataset, model, optimizers,
                           move, max_steps)
        peers.follow(progress)

        metrics = open_run_folder(accelerator, run, resume, progress, recipe, cfg.log.wandb_project, cfg.log.run_name)
        checkpoints = Checkpointer(accelerator, run, arch, plan.names, cfg.run.keep_last, healthy=evals.finite_loss,
                                   engine=parallelism, trained=optimizers)
        nan_policy = NonFinitePolicy(cfg.training.on_nan, cfg.training.max_nan_skips, run, accelerator)
        schedule = LRSchedule(cfg.optim.warmup_steps, max_steps, cfg.optim.min_lr_ratio)
        report = StepReport(cfg.log, accelerator, max_steps, progress.step, geometry.tokens_per_step, flops_per_token,
                            clock)
        accelerator.print(run_header(accelerator, parallelism, model, n_params, geometry, plan, cfg.training.grad_clip,
                                     cfg.model.lora_summary,
                                     source.describe(), Attempt.of_launch().describe(),
                                     runs_here(Asked.of_environment(), Machine.this())))
        # Said once steps remain to train: a resume of a finished run trains none.
        if accelerator.is_main_process and progress.step < max_steps and (warning := schedule.warmup_warning()):
            print(f"warning: {warning}", file=sys.stderr, flush=True)

        # The loop: one optimizer step, then what is due after it (a log line, evaluations, a checkpoint, a stop).
        # Pretrained weights load in eval mode, as for inference: dropout goes back on here.
        model.train()
        preempted = PreemptionFlag(announce=accelerator.is_main_process, kept=partial(what_was_kept, run))
        with TerminalBar(total=max_steps, initial=progress.step, show=accelerator.is_main_process, unit="step",
                         dynamic_ncols=True) as bar:
            while progress.step < max_steps:
                with report.timing(progress.step + 1, progress.step + 1 == max_steps):
                    lrs = plan.lrs_at(schedule.factor(progress.step))
                    # All ranks stop together if one cannot read its data.
                    with clock.phase(DATA):
                        batches = draw_step(accelerator, loader, geometry.accumulation, progress,
                                            save=partial(checkpoints.save, model, progress))
                    with clock.phase(STEP):
                        loss_sum, grad_norm = train_step(accelerator, model, optimizers, iter(batches).__next__,
                                                         geometry.accumulation, lrs, cfg.training.grad_clip,
                                                         masked_targets=loader.masked_targets,
                                                         skip_nonfinite=nan_policy.skips)
                nan_policy.after_step(progress.step + 1, grad_norm)
                progress.advance(geometry.tokens_per_step)
                bar.update(1)
                last = progress.step == max_steps
                # The host reads the device only on steps that show something; a non-finite step stops the run
                # before anything reads its loss or its weights.
                if report.logs(progress.step, last) or evals.due(progress.step, last):
                    nan_policy.check()
                record = report.of_step(progress.step, last, loss_sum / geometry.accumulation, lrs[0], grad_norm,
                                        progress.tokens, write=bar.write)

                with clock.phase(EVAL) as evaluating:
                    evaluated = evals.run_due(model, progress.step, last, write=bar.write)
                if evaluated:
                    record.update(evaluated, eval_s=round(evaluating.seconds, 4))

                stop = preempted.any_rank(accelerator)
                if progress.step % cfg.run.save_every == 0 or last or stop:
                    nan_policy.check()
                    with clock.phase(CHECKPOINT) as saving:
                        saved = checkpoints.save(model, progress, loader.state_dict())
                    uploads.checkpoint_saved(progress.step, saved)
                    record["checkpoint_s"] = round(saving.seconds, 4)
                metrics.log(progress.step, record)
                if stop:
                    accelerator.print(preempted.stopped_at(progress.step, last))
                    break

        # Shutdown. A finished run exports final/ with its card; the optimizer state is already in the last
        # checkpoint, so its memory goes to the export.
        if finished := progress.step == max_steps:
            release_optimizer_state(optimizers)
            export_final(accelerator, model, arch, run, init_weights, parallelism=parallelism)
            accelerator.print(evals.next_steps(run.path))
            if accelerator.is_main_process:
                write_card(run.path, hub_model_id=cfg.hub.hub_model_id if cfg.hub.push_to_hub else None)
        accelerator.print(clock.summary())
        # gloo processes that exit with live tensors and an open group abort now and then: end in order.
        accelerator.wait_for_everyone()
        del model, optimizers
        gc.collect()
        accelerator.end_training()
    # The final push starts once the group is gone, so that no rank waits in a collective during the upload.
    uploads.wait()
    if finished:
        uploads.push_final()


if __name__ == "__main__":
    run_cli(main)
