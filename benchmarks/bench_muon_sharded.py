"""What Muon's step costs: under FSDP2 against DDP (issue 47), and stacked and split over the ranks against one matrix
at a time on every rank (issue 53), on the same processes.

    torchrun --nproc_per_node 2 -m benchmarks.bench_muon_sharded                 # CPU default: 4 x 256, ~3 min
    torchrun --nproc_per_node 2 -m benchmarks.bench_muon_sharded --n_layer 2 --n_embd 64 --trials 3   # a smoke run
    torchrun --nproc_per_node 2 -m benchmarks.bench_muon_sharded --sides ddp,ddp_stacked,ddp_per_matrix --muon_only
    ... --json results.json                                                       # also write the figures as JSON

On a CPU (gloo) it runs as written; with GPUs each rank takes the GPU of its LOCAL_RANK (nccl). Every side is the
project's own optimizers (`training.optimizers.plan.build_optimizer`: AdamW, and our `Muon` on the blocks' matrices) on
the
same model, weights and batches:
- `fsdp2`: torch's `fully_shard` on each block, then on the whole model (the units accelerate's FSDP2 plugin wraps
  with its transformer-layer policy), every parameter a DTensor sharded by rows over the ranks; Muon gathers each
  matrix whole with one all-gather, runs Newton-Schulz on every rank and keeps its own rows;
- `ddp`: `DistributedDataParallel`, Muon as train.py runs it there (`training.distributed.prepare`): each shape's
matrices
  stacked, each rank orthogonalising its share and one all-gather per shape giving it the rest;
- `ddp_stacked`: the same, stacked but not split (every rank orthogonalises every matrix);
- `ddp_per_matrix`: one matrix at a time on every rank (`Muon.stacked = False`: torch's loop, the step before issue
  53).
A step is `--grad_accum` micro-batches of forward and backward, `clip_grad_norm_` (train.py's default 1.0), AdamW's
and Muon's steps and `zero_grad`; the Muon step (`muon.step()`) is timed on its own inside it. `--muon_only` times the
Muon step alone, on the gradients of one such step kept (the same on every rank, as DDP leaves them): more trials in
less time. Each timing is the slowest rank's (an all-reduce MAX after a barrier). Warm-up steps first, then the sides
take turns in every trial (the order rotating from trial to trial) so that a machine busy with other jobs slows each
alike; medians are printed, with the bytes each rank gathers for Muon per step under FSDP2 (every matrix whole, in
fp32). Before timing, the `ddp` side's split step is checked against one process's stacked step from the same
weights, momentum and gradients: every weight equal bit for bit on every rank (each matrix's Newton-Schulz runs the
same kernels whichever rank runs it), else it stops with exit status 1. `--compile` compiles the stacked
Newton-Schulz (inductor), as a run that compiles does. Timing: run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from configs import ModelConfig, OptimConfig, TrainingConfig
from model import GPT, GPTConfig
from training.optimizers import muon as muon_module
from training.optimizers.muon_optimizer import Muon
from training.optimizers.plan import build_optimizer, plan_optimizers
from training.optimizers.spec import BLOCK_MATRICES, StepPlacement, claimed_names

GRAD_CLIP = TrainingConfig().grad_clip  # train.py's default
SIDES = ("fsdp2", "ddp", "ddp_stacked", "ddp_per_matrix")


def build_side(side: str, config: GPTConfig, device: torch.device, compile_backend: str | None = None
               ) -> tuple[torch.nn.Module, list]:
    torch.manual_seed(1337)  # the same initial weights on every side and every rank
    model = GPT(config).to(device)
    if side == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        assert all(hasattr(p, "full_tensor") for p in model.parameters())  # every parameter a sharded DTensor
        optimizers = build_optimizer(model, plan_optimizers(OptimConfig(optimizer="muon"), ModelConfig()),
                                     device.type)
        return model, optimizers
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    adamw, muon = build_optimizer(model, plan_optimizers(OptimConfig(optimizer="muon"), ModelConfig()), device.type)
    if side == "ddp":  # as training.distributed.prepare places it: split over DDP's group
        muon_module.place(muon, StepPlacement(ddp.process_group, dist.get_world_size(ddp.process_group),
                                              compile_backend))
    elif side == "ddp_stacked":
        muon_module.place(muon, StepPlacement(compile_backend=compile_backend))
    else:
        muon.stacked = False
    return ddp, [adamw, muon]


def slowest(seconds: float, device: torch.device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def muon_step(optimizers: list, grads: list[torch.Tensor], device: torch.device) -> tuple[float, float]:
    """`--muon_only`: (the Muon step's seconds, twice), this rank's, on the gradients `grads` (kept from a step)."""
    muon = optimizers[1]
    for p, grad in zip(muon_params(muon), grads):
        p.grad = grad
    dist.barrier()
    sync(device)
    start = time.perf_counter()
    muon.step()
    sync(device)
    seconds = time.perf_counter() - start
    return seconds, seconds


def muon_params(muon: Muon) -> list[torch.nn.Parameter]:
    return [p for group in muon.param_groups for p in group["params"]]


def check_split(muon: Muon) -> int:
    """One Muon step of `muon` (split over the ranks) against one process's stacked step (no split) from copies of
    its weights, momentum and gradients: the number of matrices whose weights differ in any bit (0 expected) on the
    rank with the most. Leaves `muon`'s own weights and momentum as they were."""
    params = muon_params(muon)
    weights = [p.detach().clone() for p in params]
    momenta = {p: {k: v.clone() for k, v in muon.state[p].items()} for p in params if p in muon.state}
    copies = [torch.nn.Parameter(w.clone()) for w in weights]
    reference = Muon(copies, ns_dtype=muon.ns_dtype, **{k: v for k, v in muon.param_groups[0].items()
                                                        if k not in ("params", "adjust_lr_fn")})
    for p, copy in zip(params, copies):
        copy.grad = p.grad.clone()
        if p in momenta:
            reference.state[copy] = {k: v.clone() for k, v in momenta[p].items()}
    muon.step()
    reference.step()
    differ = torch.tensor([sum(not torch.equal(p, copy) for p, copy in zip(params, copies))], device=weights[0].device)
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
    for p in params:
        if p in momenta:
            muon.state[p] = momenta[p]
        else:
            muon.state.pop(p, None)
    dist.all_reduce(differ, op=dist.ReduceOp.MAX)  # the rank with the most
    return int(differ.item())


def one_step(model: torch.nn.Module, optimizers: list, batches: list[tuple[torch.Tensor, torch.Tensor]],
             device: torch.device, keep_grads: bool = False) -> tuple[float, float]:
    """(the whole step's seconds, the Muon step's), this rank's. `keep_grads`: stop before the optimizers' steps,
    leaving the clipped gradients in place (for `check_split` and `--muon_only`)."""
    dist.barrier()
    sync(device)
    start = time.perf_counter()
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        no_sync = model.no_sync() if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last \
            else nullcontext()
        with no_sync:
            (model(x, y)[1] / len(batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    if keep_grads:
        return 0.0, 0.0
    adamw, muon = optimizers
    adamw.step()
    sync(device)
    muon_start = time.perf_counter()
    muon.step()
    sync(device)
    muon_seconds = time.perf_counter() - muon_start
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - start, muon_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--grad_accum", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    parser.add_argument("--trials", type=int, default=10, help="timed steps per side")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"which of {', '.join(SIDES)} to time")
    parser.add_argument("--muon_only", action="store_true", help="time the Muon step alone (kept gradients)")
    parser.add_argument("--compile", action="store_true", help="compile the stacked Newton-Schulz (inductor)")
    parser.add_argument("--json", help="also write the figures to this file (rank 0)")
    args = parser.parse_args()
    sides_run = tuple(side for side in args.sides.split(",") if side)
    if unknown := set(sides_run) - set(SIDES):
        parser.error(f"--sides: unknown {sorted(unknown)}; choose from {', '.join(SIDES)}")

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                       dropout=0.0)
    backend = "inductor" if args.compile else None
    sides = {side: build_side(side, config, device, backend) for side in sides_run}
    g = torch.Generator().manual_seed(rank)  # each rank its own share of the batch, the same for every side
    batches = [(torch.randint(0, config.vocab_size, (args.micro_batch_size, args.block_size), generator=g).to(device),
                torch.randint(0, config.vocab_size, (args.micro_batch_size, args.block_size), generator=g).to(device))
               for _ in range(args.grad_accum)]

    kept: dict[str, list[torch.Tensor]] = {}  # each side's Muon gradients of one step (--muon_only)
    for side, (model, optimizers) in sides.items():
        if side == "ddp" or args.muon_only:
            one_step(model, optimizers, batches, device, keep_grads=True)
            kept[side] = [p.grad for p in muon_params(optimizers[1])]
        if side == "ddp":
            differ = check_split(optimizers[1])
            if rank == 0 and world > 1:
                matrices = len(kept[side])
                print(f"ddp: Muon's step split over {world} ranks against one process's: {matrices - differ} of "
                      f"{matrices} matrices equal bit for bit on every rank")
            if differ:
                raise SystemExit(1)
        for opt in optimizers:
            if not args.muon_only:
                opt.zero_grad(set_to_none=True)

    times: dict[str, dict[str, list[float]]] = {side: {"step": [], "muon": []} for side in sides_run}
    for trial in range(args.warmup + args.trials):
        shift = trial % len(sides_run)  # every side first in turn
        for side in sides_run[shift:] + sides_run[:shift]:
            if args.muon_only:
                step_seconds, muon_seconds = muon_step(sides[side][1], kept[side], device)
            else:
                step_seconds, muon_seconds = one_step(*sides[side], batches, device)
            step_seconds, muon_seconds = slowest(step_seconds, device), slowest(muon_seconds, device)
            if trial >= args.warmup:
                times[side]["step"].append(step_seconds)
                times[side]["muon"].append(muon_seconds)

    reference = GPT(config)
    gathered = sum(p.numel() for name, p in reference.named_parameters()
                   if name in set(claimed_names(reference, BLOCK_MATRICES))) * 4
    if rank == 0:
        medians = {side: {k: statistics.median(v) for k, v in kinds.items()} for side, kinds in times.items()}
        print(f"{world} processes ({'nccl' if cuda else 'gloo'}), GPT {args.n_layer} x {args.n_embd}, block "
              f"{args.block_size}, {args.micro_batch_size} x {args.grad_accum} sequences a rank and step; "
              f"{args.trials} trials, medians of the slowest rank"
              + ("; the Muon step alone" if args.muon_only else "") + ("; compiled" if args.compile else ""))
        print(f"Muon gathers {4 * args.n_layer} matrices whole per step under FSDP2: {gathered / 2 ** 20:.2f} MiB "
              "a rank (fp32)")
        for side in sides_run:
            whole = "" if args.muon_only else f"whole step {medians[side]['step'] * 1e3:9.1f} ms   "
            print(f"{side:14s}  {whole}Muon step {medians[side]['muon'] * 1e3:9.1f} ms")
        for a, b in (("fsdp2", "ddp"), ("ddp", "ddp_per_matrix"), ("ddp_stacked", "ddp_per_matrix"),
                     ("ddp", "ddp_stacked")):
            if a in medians and b in medians:
                whole = "" if args.muon_only else f"whole step x{medians[a]['step'] / medians[b]['step']:.2f}, "
                print(f"{a} / {b}: {whole}Muon step x{medians[a]['muon'] / medians[b]['muon']:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "world": world, "gathered_bytes": gathered, "medians": medians,
                           "times": times}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
