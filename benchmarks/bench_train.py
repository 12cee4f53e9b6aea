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
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import resource
import statistics
import time
from typing import Callable

import torch
from accelerate import Accelerator

from common.errors import UserError, run_cli
from configs import ModelConfig, OptimConfig, TrainingConfig
from model import GPT, GPTConfig
from model.loss import default_loss_chunk_rows, describe_loss_path
from training.mfu import estimate_mfu, peak_flops
from training.optim import build_optimizer, plan_optimizers
from training.preemption import PreemptionFlag
from training.step import LRSchedule, train_step

GRAD_CLIP = TrainingConfig().grad_clip  # train.py's default

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
    args = p.parse_args()
    if min(args.micro_batch_size, args.grad_accum, args.steps, args.trials) < 1 or args.warmup < 0:
        raise UserError("--micro_batch_size, --grad_accum, --steps and --trials must be >= 1, --warmup >= 0")
    if args.loss_chunk_rows is not None and args.loss_chunk_rows < 0:
        raise UserError(f"--loss_chunk_rows must be 0 (the full logits) or a number of rows per chunk, got "
                        f"{args.loss_chunk_rows}; pass 0 or e.g. 512, or leave it out for the device's default")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is visible; use --device cpu or auto")
    return args


def main() -> None:
    args = parse_args()
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
    # The optimizer comes from the same config group and plan as in train.py, so both sides build it alike.
    optim = OptimConfig(warmup_steps=max(1, (args.warmup + args.steps) // 10),
                        **({} if args.optimizer is None else {"optimizer": args.optimizer}))
    plan = plan_optimizers(optim, ModelConfig())  # from scratch
    schedule = LRSchedule(optim.warmup_steps, args.warmup + args.steps, optim.min_lr_ratio)

    torch.manual_seed(1337)
    acc_model = GPT(config)
    acc_model.loss_chunk_rows = args.loss_chunk_rows  # None: the device's default, resolved in the forward
    bare_model = copy.deepcopy(acc_model).to(device)  # the same path on both sides
    loss_rows = default_loss_chunk_rows(device.type) if args.loss_chunk_rows is None else args.loss_chunk_rows
    flops_per_token = acc_model.flops_per_token()
    n_params = acc_model.num_params()
    acc_opts = build_optimizer(acc_model, plan, device.type)  # [AdamW] or [AdamW, Muon], as in train.py
    bare_opts = build_optimizer(bare_model, plan, device.type)
    acc_model, *acc_opts = accelerator.prepare(acc_model, *acc_opts)
    bare_fwd = torch.compile(bare_model) if args.compile else bare_model
    acc_model.train()
    bare_model.train()
    preempted = PreemptionFlag()

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

    def run(side: str, n: int) -> float:
        """Run `n` optimizer steps of one side; returns the seconds they took."""
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            lrs = plan.lrs_at(schedule.factor(steps[side]))
            if side == "accelerate":
                loss_sum, _ = train_step(accelerator, acc_model, acc_opts, streams[side], A, lrs, GRAD_CLIP)
                if preempted.any_rank(accelerator):  # train.py checks this after every step
                    raise SystemExit("signal received: benchmark stopped")
            else:
                loss_sum = bare_step(bare_fwd, bare_opts, streams[side], A, lrs, GRAD_CLIP, device, bf16)
            steps[side] += 1
        sync()
        seconds = time.perf_counter() - t0
        if n:
            last_loss[side] = float(loss_sum) / A  # mean over the last step's micro-batches
        return seconds

    print(f"GPT {n_params / 1e6:.2f}M params | {config.n_layer}L {config.n_head}H {config.n_embd}E | "
          f"{A} x {B} x {T} = {A * B * T:,} tokens/step | {args.mixed_precision} | compile={args.compile} | "
          f"{describe_loss_path(loss_rows)} | {device} ({torch.get_num_threads()} threads)")
    t0 = time.perf_counter()
    for side in ("accelerate", "bare"):
        run(side, args.warmup)
    warmup_s = time.perf_counter() - t0
    print(f"warmup: {args.warmup} step(s) per side, {warmup_s:.1f} s")

    trials = min(args.trials, args.steps)
    per_trial = [args.steps // trials + (i < args.steps % trials) for i in range(trials)]
    seconds = {"accelerate": [], "bare": []}
    peak_mem = {"accelerate": 0, "bare": 0}
    for i, n in enumerate(per_trial):
        for side in (("accelerate", "bare") if i % 2 == 0 else ("bare", "accelerate")):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            seconds[side].append(run(side, n))
            if device.type == "cuda":
                peak_mem[side] = max(peak_mem[side], torch.cuda.max_memory_allocated())
        print(f"trial {i + 1}/{trials}: {n} steps | accelerate {seconds['accelerate'][-1]:.2f} s | "
              f"bare {seconds['bare'][-1]:.2f} s")

    peak = peak_flops(device)
    tok_s = {side: A * B * T * args.steps / sum(s) for side, s in seconds.items()}
    # The best trial is the one least disturbed by other jobs on a shared machine.
    best = {side: A * B * T * max(n / t for n, t in zip(per_trial, s)) for side, s in seconds.items()}
    print(f"\n{'side':<11} {'tokens/s':>12} {'best trial':>12} {'MFU':>8} {'last loss':>10}")
    mfus = {}
    for side in ("accelerate", "bare"):
        mfu = mfus[side] = estimate_mfu(flops_per_token, tok_s[side], 1, peak)
        print(f"{side:<11} {tok_s[side]:>12,.0f} {best[side]:>12,.0f} {'None' if mfu is None else f'{mfu:.1%}':>8} "
              f"{last_loss[side]:>10.4f}")
    paired = [b / a for a, b in zip(seconds["accelerate"], seconds["bare"])]
    ratio = tok_s["accelerate"] / tok_s["bare"]
    print(f"accelerate / bare tokens/s: {ratio:.3f} overall, {best['accelerate'] / best['bare']:.3f} best trials, "
          f"{statistics.median(paired):.3f} median of paired trials (range {min(paired):.3f}-{max(paired):.3f}); "
          f"overhead {1 - ratio:+.1%} (target <= 3%)")
    if device.type == "cuda":  # both models and optimizers stay resident, so the difference is what counts
        print("peak memory allocated: " + " | ".join(f"{s} {m / 2**30:.2f} GiB" for s, m in peak_mem.items()))
    else:  # ru_maxrss is in KiB on Linux and covers the whole process (both sides)
        print(f"peak memory: process max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB "
              "(both sides)")
    max_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        figures = {
            "model": args.model, "n_params": n_params, "n_layer": config.n_layer, "n_embd": config.n_embd,
            "block_size": T, "micro_batch_size": B, "grad_accum": A, "tokens_per_step": A * B * T,
            "mixed_precision": args.mixed_precision, "compile": args.compile, "device": str(device),
            "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "steps": args.steps, "warmup_steps": args.warmup, "warmup_s": warmup_s,
            # What the CUDA code paths turned on: fused AdamW (training/optim.py) and TF32 matmuls.
            "optimizer": plan.kind,
            "loss_chunk_rows": loss_rows,  # the loss's path both sides ran: 0 the full logits, else rows per chunk
            "optimizer_fused": bool(getattr(acc_opts[0], "optimizer", acc_opts[0]).defaults.get("fused")),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "ratio_overall": ratio, "ratio_median_paired": statistics.median(paired),
            "peak_flops": peak, "max_rss_gib": max_rss_gib, "load_average": os.getloadavg()[0],
        }
        for side in ("accelerate", "bare"):
            figures[side] = {"tokens_per_s": tok_s[side], "best_trial_tokens_per_s": best[side], "mfu": mfus[side],
                             "last_loss": last_loss[side],
                             "peak_mem_gib": peak_mem[side] / 2**30 if device.type == "cuda" else None}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    run_cli(main)
