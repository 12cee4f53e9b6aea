"""What train.py's Accelerate loop costs over a bare PyTorch loop: same model, same batches.

    python -m benchmarks.bench_train                          # CPU default: `mini`, block 128, ~2 min on 2 cores
    python -m benchmarks.bench_train --model gpt2 --block_size 1024 --micro_batch_size 16 \
        --mixed_precision bf16 --compile                      # one GPU
    ... --json results.json                                   # also write the figures as JSON
    ... --loss_chunk_rows 0                                   # the loss's path on both sides (default: the device's)

Side (a) is train.py's own `train_step`: Accelerator with
gradient_accumulation_steps, prepare(model, optimizer), `accumulate`, `backward`, `clip_grad_norm_`,
float(grad_norm), step/zero_grad, LR from `training.step.LRSchedule`, and the preemption all-reduce.
Side (b) is the plain loop: autocast when bf16, loss / accum, backward, torch's clip_grad_norm_,
AdamW step. Both start from the same weights and read the same pre-generated random batches.
Warmup steps run first and are not timed; then the sides alternate in trials (order flipped every
trial) so that a machine busy with other jobs slows both alike.

Both sides are built as train.py builds its step: the optimizers from the same plan, Muon told where its step runs
(`training.distributed.prepare`: with --compile its Newton-Schulz is compiled, on the bare side too), and with
--compile both models compiled with accelerate's dynamo settings.

The GPU window's sweep (benchmarks/gpu_acceptance.py, stage `sweep`) runs side (a) alone (`--accelerate_only`) once
per variant: the loss path (`--loss_chunk_rows`, set on the model), Muon's layout (`--muon_stacked`,
`--muon_per_matrix`, set on the optimizer) and the attention kernel (`--sdpa_backend`, held with
`torch.nn.attention.sdpa_kernel` for the whole run, so that dynamo traces the chosen op), trials sized by time
(`--time_budget`), the optimizer step's and the clip's time (`--phases`), then one step under torch.profiler
(`--profile`: also which SDPA kernel ran) and one step's host syncs (`--sync_count`: an eager step, so only at a
shape where one fits in memory); benchmarks/step_probe.py says how each is measured. `--require_knobs` refuses a knob
this code does not have, before any step, rather than measure the default under another name. The JSON records what
ran: the card (as the MFU peak table names it) and its memory, cuDNN's version, the compile's backend and mode, the
allocator's settings.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import itertools
import json
import math
import os
import resource
import statistics
import time
from typing import Callable

import torch
from accelerate import Accelerator
from torch._dynamo.utils import counters as dynamo_counters

from benchmarks.step_probe import Phases, count_syncs, probe, profile_step
from common.errors import UserError, run_cli
from configs import ModelConfig, TrainingConfig, parse_config
from model import GPT, GPTConfig
from model.loss import describe_loss_path, loss_chunk_rows_on
from training.distributed.prepare import prepare, step_placement
from training.evaluations import registry  # noqa: F401  the preset's evaluation flags (--hellaswag_every)
from training.mfu import card_for_name, estimate_mfu, peak_flops
from training.optimizers.plan import build_optimizer, plan_optimizers
from training.preemption import PreemptionFlag
from training.step import LRSchedule, train_step

GRAD_CLIP = TrainingConfig().grad_clip  # train.py's default
GPT2_PRESET = "gpt2_124m_fineweb_edu_muon.yaml"  # the optimizer's settings (main())
# --sdpa_backend's names for torch.nn.attention.SDPBackend's members.
SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}

Batch = tuple[torch.Tensor, torch.Tensor]


def bare_step(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], next_batch: Callable[[], Batch],
              grad_accum: int, lrs: list[float], grad_clip: float, device: torch.device, bf16: bool) -> torch.Tensor:
    """The same optimizer step in plain PyTorch, nanoGPT style. Returns the summed micro-batch losses.
    `optimizers[i]` (AdamW, and Muon for the block matrices with --optimizer muon) runs at `lrs[i]`."""
    for opt, lr in zip(optimizers, lrs, strict=True):
        for group in opt.param_groups:
            group["lr"] = lr
    loss_sum = torch.zeros((), device=device)
    for _ in range(grad_accum):
        x, y = next_batch()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        (loss / grad_accum).backward()
        loss_sum += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss_sum


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mini", help="size preset: tiny, mini, small, gpt2, ...")
    p.add_argument("--n_layer", type=int)
    p.add_argument("--n_head", type=int)
    p.add_argument("--n_embd", type=int)
    p.add_argument("--block_size", type=int, help="default: the preset's")
    p.add_argument("--micro_batch_size", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=2, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=16, help="timed optimizer steps per side (split into trials)")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps per side first")
    p.add_argument("--trials", type=int, default=8, help="alternating rounds the timed steps are split into")
    p.add_argument("--optimizer", help="train.py's --optimizer, resolved as train.py does (default: the config's)")
    p.add_argument("--mixed_precision", choices=("no", "bf16"), default="no")
    p.add_argument("--compile", action="store_true", help="torch.compile (inductor) on both sides")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--loss_chunk_rows", type=int, help="the training loss's path on both sides (train.py's flag): 0 "
                   "the full logits, N the logits N tokens at a time; default: the device's (512 on a CPU, 0 on a GPU)")
    p.add_argument("--json", help="also write the figures to this JSON file (benchmarks/gpu_acceptance.py reads it)")
    muon = p.add_mutually_exclusive_group()
    muon.add_argument("--muon_stacked", dest="muon_stacked", action="store_const", const=True,
                      help="Muon orthogonalises same-shape matrices together (default: the optimizer's)")
    muon.add_argument("--muon_per_matrix", dest="muon_stacked", action="store_const", const=False,
                      help="Muon orthogonalises one matrix at a time")
    p.add_argument("--sdpa_backend", choices=tuple(SDPA_BACKENDS),
                   help="the attention kernel on both sides, for the whole run (default: SDPA's own choice); a "
                   "kernel the device lacks fails the first step")
    p.add_argument("--require_knobs", action="store_true",
                   help="refuse --loss_chunk_rows / --muon_* / --sdpa_backend where the model, Muon or torch has no "
                   "such knob")
    p.add_argument("--accelerate_only", action="store_true", help="time train.py's step alone, no bare loop")
    p.add_argument("--time_budget", type=float,
                   help="seconds of timed steps per side instead of --steps: --trials trials of equal steps, sized "
                   "by the last warmup step's time")
    p.add_argument("--phases", action="store_true",
                   help="time the optimizer step and the clip inside train.py's step (benchmarks/step_probe.py)")
    p.add_argument("--sync_count", action="store_true", help="then count the host syncs of one train.py step")
    p.add_argument("--profile", action="store_true", help="then profile one train.py step (torch.profiler)")
    args = p.parse_args()
    if min(args.micro_batch_size, args.grad_accum, args.steps, args.trials) < 1 or args.warmup < 0:
        raise UserError("--micro_batch_size, --grad_accum, --steps and --trials must be >= 1, --warmup >= 0")
    if args.time_budget is not None and (args.time_budget <= 0 or args.warmup < 1):
        raise UserError("--time_budget needs a positive number of seconds and --warmup >= 1 (the step it sizes from)")
    if args.loss_chunk_rows is not None and args.loss_chunk_rows < 0:
        raise UserError(f"--loss_chunk_rows must be 0 (the full logits) or a number of rows per chunk, got "
                        f"{args.loss_chunk_rows}; pass 0 or e.g. 512, or leave it out for the device's default")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is visible; use --device cpu or auto")
    return args


def attention_backend(name: str | None) -> contextlib.AbstractContextManager:
    """The `--sdpa_backend` kernel for what runs inside (dynamo traces the op it selects), or nothing chosen. A torch
    that cannot choose it is refused (KNOB_UNKNOWN, as `--require_knobs`): the run would measure the default."""
    if name is None:
        return contextlib.nullcontext()
    import torch.nn.attention as attention

    member = getattr(getattr(attention, "SDPBackend", None), SDPA_BACKENDS[name], None)
    if member is None or not hasattr(attention, "sdpa_kernel"):
        raise UserError(f"KNOB_UNKNOWN sdpa_backend: torch {torch.__version__} cannot choose the {name} attention "
                        "kernel (torch.nn.attention.sdpa_kernel); leave --sdpa_backend out for SDPA's own choice")
    return attention.sdpa_kernel([member])


def main() -> None:
    args = parse_args()
    with attention_backend(args.sdpa_backend):
        measure(args)


def measure(args: argparse.Namespace) -> None:
    """Both sides' steps, timed; the figures printed and written (--json)."""
    overrides = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "block_size") if getattr(args, k)}
    config = GPTConfig.from_name(args.model, **overrides)
    use_cpu = args.device == "cpu" or not torch.cuda.is_available()
    device = torch.device("cpu" if use_cpu else "cuda")
    bf16 = args.mixed_precision == "bf16"
    if device.type == "cuda":  # as train.py does
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    accelerator = Accelerator(cpu=use_cpu, gradient_accumulation_steps=args.grad_accum,
                              mixed_precision=args.mixed_precision,
                              dynamo_backend="inductor" if args.compile else "no")
    # The optimizer comes from the same config group and plan as in train.py, so both sides build it alike; its
    # settings are the GPT-2 124M Muon preset's (the defaults are the small CPU run's: an LR of 3e-2 would diverge
    # here), its warmup this benchmark's length.
    preset = parse_config(["--config", GPT2_PRESET])
    optim = dataclasses.replace(preset.optim, warmup_steps=max(1, (args.warmup + args.steps) // 10),
                                **({} if args.optimizer is None else {"optimizer": args.optimizer}))
    plan = plan_optimizers(optim, ModelConfig(), preset.added)  # from scratch
    schedule = LRSchedule(optim.warmup_steps, args.warmup + args.steps, optim.min_lr_ratio)

    torch.manual_seed(1337)
    acc_model = GPT(config)
    knobs = {"loss_chunk_rows": hasattr(acc_model, "loss_chunk_rows")}  # which of the sweep's knobs this code has
    acc_model.loss_chunk_rows = args.loss_chunk_rows  # None: the device's default, resolved in the forward
    loss_rows = loss_chunk_rows_on(device.type, args.loss_chunk_rows)
    sides = ("accelerate",) if args.accelerate_only else ("accelerate", "bare")
    bare_model = None if args.accelerate_only else copy.deepcopy(acc_model).to(device)  # the same path on both sides
    flops_per_token = acc_model.flops_per_token()
    n_params = acc_model.num_params()
    acc_opts = build_optimizer(acc_model, plan, device.type)  # [AdamW] or [AdamW, Muon], as in train.py
    bare_opts = [] if bare_model is None else build_optimizer(bare_model, plan, device.type)
    muons = [o for o in acc_opts + bare_opts if any(c.__name__ == "Muon" for c in type(o).__mro__)]
    knobs["muon_stacked"] = bool(muons) and all(hasattr(o, "stacked") for o in muons)
    if args.muon_stacked is not None:
        if not muons:
            raise UserError("--muon_stacked / --muon_per_matrix need Muon (--optimizer muon)")
        for o in muons:
            o.stacked = args.muon_stacked
    if args.require_knobs:
        asked = {"loss_chunk_rows": args.loss_chunk_rows is not None, "muon_stacked": args.muon_stacked is not None}
        unknown = [k for k, v in asked.items() if v and not knobs[k]]
        if unknown:
            raise UserError(f"KNOB_UNKNOWN {','.join(unknown)}: this code has no such attribute; the variant would "
                            "measure the default")
    # As train.py: Muon learns where its step runs (with --compile its stacked Newton-Schulz is compiled); the bare
    # side's Muon the same, and its model compiled with accelerate's dynamo settings, so both are compiled alike.
    acc_model, *acc_opts = prepare(accelerator, acc_model, acc_opts, plan)
    placement = step_placement(accelerator, acc_model)
    if len(bare_opts) > 1 and plan.spec.place is not None:
        plan.spec.place(bare_opts[-1], placement)
    dynamo = accelerator.state.dynamo_plugin
    bare_fwd = bare_model if bare_model is None or not args.compile else torch.compile(bare_model,
                                                                                       **dynamo.to_kwargs())
    acc_model.train()
    if bare_model is not None:
        bare_model.train()
    preempted = PreemptionFlag()
    phases = Phases(device)
    if args.phases or args.sync_count:  # train_step calls these on the instances it is given
        for opt in acc_opts:
            phases.wrap(opt, "step", "optimizer")
        phases.wrap(accelerator, "clip_grad_norm_", "clip")

    # Random token blocks, made once; both sides walk through them in the same order.
    B, T, A = args.micro_batch_size, config.block_size, args.grad_accum
    n_batches = A * min(args.warmup + args.steps, 8)
    data = torch.randint(0, config.vocab_size, (n_batches, B, T + 1), generator=torch.Generator().manual_seed(0))
    batches: list[Batch] = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]

    def stream() -> Callable[[], Batch]:
        order = itertools.cycle(batches)
        return lambda: next(order)

    steps = {"accelerate": 0, "bare": 0}
    streams = {"accelerate": stream(), "bare": stream()}
    last_loss: dict[str, float] = {}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step_once(side: str) -> torch.Tensor:
        """One optimizer step of one side (train.py's: the step, then its preemption check); the summed losses."""
        lrs = plan.lrs_at(schedule.factor(steps[side]))
        if side == "accelerate":
            loss_sum, _ = train_step(accelerator, acc_model, acc_opts, streams[side], A, lrs, GRAD_CLIP)
            if preempted.any_rank(accelerator):  # train.py checks this after every step
                raise SystemExit("signal received: benchmark stopped")
        else:
            loss_sum = bare_step(bare_fwd, bare_opts, streams[side], A, lrs, GRAD_CLIP, device, bf16)
        steps[side] += 1
        return loss_sum

    def run(side: str, n: int) -> float:
        """Run `n` optimizer steps of one side; returns the seconds they took."""
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            loss_sum = step_once(side)
        sync()
        seconds = time.perf_counter() - t0
        if n:
            last_loss[side] = float(loss_sum) / A  # mean over the last step's micro-batches
        return seconds

    print(f"GPT {n_params / 1e6:.2f}M params | {config.n_layer}L {config.n_head}H {config.n_embd}E | "
          f"{A} x {B} x {T} = {A * B * T:,} tokens/step | {args.mixed_precision} | compile={args.compile} | "
          f"{describe_loss_path(loss_rows, device.type)} | {device} ({torch.get_num_threads()} threads)")
    t0 = time.perf_counter()
    first_s, first_loss, warm_step_s = {}, {}, {}
    for side in sides:  # the first step (the compile, if any), the untimed ones, the last of them timed alone
        first_s[side] = run(side, min(1, args.warmup))
        first_loss[side] = last_loss.get(side)
        run(side, max(0, args.warmup - 2))
        warm_step_s[side] = run(side, 1) if args.warmup > 1 else first_s[side]
    warmup_s = time.perf_counter() - t0
    print(f"warmup: {args.warmup} step(s) per side, {warmup_s:.1f} s (first step: "
          + ", ".join(f"{s} {first_s[s]:.2f} s" for s in sides) + ")")
    graph_breaks = sum(dynamo_counters["graph_break"].values())

    if args.time_budget is not None:  # trials of equal steps, each about time_budget / trials seconds
        per_step = max(max(warm_step_s.values()), 1e-6)
        per_trial = [max(1, math.ceil(args.time_budget / args.trials / per_step))] * args.trials
    else:
        trials = min(args.trials, args.steps)
        per_trial = [args.steps // trials + (i < args.steps % trials) for i in range(trials)]
    timed_steps = sum(per_trial)
    seconds = {side: [] for side in sides}
    peak_mem = {side: 0 for side in sides}
    phases.reset()
    for i, n in enumerate(per_trial):
        for side in (sides if i % 2 == 0 else sides[::-1]):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            seconds[side].append(run(side, n))
            if device.type == "cuda":
                peak_mem[side] = max(peak_mem[side], torch.cuda.max_memory_allocated())
        print(f"trial {i + 1}/{len(per_trial)}: {n} steps | "
              + " | ".join(f"{side} {seconds[side][-1]:.2f} s" for side in sides))
    phase_ms = {p: ms / timed_steps for p, ms in phases.total_ms().items()} if args.phases else {}
    if phase_ms:
        print("train.py's step, per step: " + " | ".join(f"{p} {ms:.2f} ms" for p, ms in phase_ms.items()))

    peak = peak_flops(device)
    tok_s = {side: A * B * T * timed_steps / sum(s) for side, s in seconds.items()}
    # The best trial is the one least disturbed by other jobs on a shared machine.
    best = {side: A * B * T * max(n / t for n, t in zip(per_trial, s)) for side, s in seconds.items()}
    print(f"\n{'side':<11} {'tokens/s':>12} {'best trial':>12} {'MFU':>8} {'last loss':>10}")
    mfus = {}
    for side in sides:
        mfu = mfus[side] = estimate_mfu(flops_per_token, tok_s[side], 1, peak)
        print(f"{side:<11} {tok_s[side]:>12,.0f} {best[side]:>12,.0f} {'None' if mfu is None else f'{mfu:.1%}':>8} "
              f"{last_loss[side]:>10.4f}")
    ratio = paired = None
    if "bare" in sides:
        paired = [b / a for a, b in zip(seconds["accelerate"], seconds["bare"])]
        ratio = tok_s["accelerate"] / tok_s["bare"]
        print(f"accelerate / bare tokens/s: {ratio:.3f} overall, {best['accelerate'] / best['bare']:.3f} best "
              f"trials, {statistics.median(paired):.3f} median of paired trials (range {min(paired):.3f}-"
              f"{max(paired):.3f}); overhead {1 - ratio:+.1%} (target <= 3%)")
    # After the timing, so that neither touches a figure above; an error in either (an OOM in the profiled step)
    # is its figure's, not the run's. The sync count last: dynamo runs a frame it has not compiled eagerly under a
    # dispatch mode.
    profile = probe("profile", lambda: profile_step(lambda: step_once("accelerate"), device)) if args.profile else None
    syncs = probe("host syncs", lambda: count_syncs(lambda: step_once("accelerate"), phases, device)) \
        if args.sync_count else None
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    expandable = probe("expandable segments", lambda: any(
        seg.get("is_expandable", False) for seg in torch.cuda.memory_snapshot())) if device.type == "cuda" else None
    if device.type == "cuda":  # both models and optimizers stay resident, so the difference is what counts
        print("peak memory allocated: " + " | ".join(f"{s} {m / 2**30:.2f} GiB" for s, m in peak_mem.items()))
    else:  # ru_maxrss is in KiB on Linux and covers the whole process (both sides)
        print(f"peak memory: process max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB "
              "(both sides)")
    max_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        figures = {
            "model": args.model, "n_params": n_params, "n_layer": config.n_layer, "n_embd": config.n_embd,
            "block_size": T, "micro_batch_size": B, "grad_accum": A, "tokens_per_step": A * B * T,
            "mixed_precision": args.mixed_precision, "compile": args.compile, "device": str(device),
            # What ran: the card as the MFU peak table names it (a target is judged on its own card), its memory,
            # cuDNN, the compile's backend and mode, whether Muon's Newton-Schulz was compiled.
            "device_name": name, "card": card_for_name(name) if device.type == "cuda" else None,
            "device_memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30
            if device.type == "cuda" else None,
            "cudnn_version": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "torch": torch.__version__, "compile_backend": dynamo.backend.value.lower() if args.compile else None,
            "compile_mode": dynamo.mode if args.compile else None,
            "muon_newton_schulz_compiled": placement.compile_backend is not None if muons else None,
            "steps": timed_steps, "steps_per_trial": per_trial,
            "warmup_steps": args.warmup, "warmup_s": warmup_s,
            # What the CUDA code paths turned on: fused AdamW (training/optimizers/plan.py) and TF32 matmuls.
            "optimizer": plan.kind,
            "loss_chunk_rows": loss_rows,  # the loss's path both sides ran: 0 the full logits, else rows per chunk
            "optimizer_fused": bool(getattr(acc_opts[0], "optimizer", acc_opts[0]).defaults.get("fused")),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "ratio_overall": ratio, "ratio_median_paired": None if paired is None else statistics.median(paired),
            "peak_flops": peak, "max_rss_gib": max_rss_gib, "load_average": os.getloadavg()[0],
            # The sweep's figures (benchmarks/gpu_acceptance.py, stage sweep): the knobs as set and whether this code
            # has them, the compile, the step's phases, host syncs and profile (None where not asked for).
            "muon_stacked": getattr(muons[0], "stacked", False) if muons else None, "knobs_in_code": knobs,
            # the attention kernel asked for (None: SDPA's choice) and the one the profiled step ran (None: not
            # profiled or none seen); the allocator's settings and whether its segments were expandable
            "sdpa_backend": args.sdpa_backend,
            "attention_kernel": profile.get("attention_kernel") if isinstance(profile, dict) else None,
            "alloc_conf": alloc_conf, "expandable_segments": expandable,
            "graph_breaks": graph_breaks, "graph_break_reasons": sorted(dynamo_counters["graph_break"])[:5],
            "phase_ms": phase_ms, "host_syncs": syncs, "profile": profile,
        }
        for side in sides:
            figures[side] = {"tokens_per_s": tok_s[side], "best_trial_tokens_per_s": best[side], "mfu": mfus[side],
                             "last_loss": last_loss[side], "first_loss": first_loss[side],
                             "first_step_s": first_s[side], "step_s": warm_step_s[side],
                             "peak_mem_gib": peak_mem[side] / 2**30 if device.type == "cuda" else None}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    run_cli(main)
