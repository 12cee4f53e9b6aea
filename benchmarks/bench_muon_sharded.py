"""What Muon costs under FSDP2: one Muon optimizer step, and the whole train step, on 2 processes sharded by FSDP2
against the same on 2 DDP processes.

    torchrun --nproc_per_node 2 -m benchmarks.bench_muon_sharded                 # CPU default: 4 x 256, ~2 min
    torchrun --nproc_per_node 2 -m benchmarks.bench_muon_sharded --n_layer 2 --n_embd 64 --trials 3   # a smoke run
    ... --json results.json                                                       # also write the figures as JSON

On a CPU (gloo) it runs as written; with GPUs each rank takes the GPU of its LOCAL_RANK (nccl). Both sides are the
project's own optimizers (`training.optimizers.plan.build_optimizer`: AdamW, and our `Muon` on the blocks' matrices,
which
under FSDP2 gathers each sharded matrix whole with one all-gather, runs Newton-Schulz on every rank and keeps its
own rows) on the same model, weights and batches:
- `fsdp2`: torch's `fully_shard` on each block, then on the whole model (the units accelerate's FSDP2 plugin wraps
  with its transformer-layer policy), every parameter a DTensor sharded by rows over the 2 ranks;
- `ddp`: `DistributedDataParallel`, every parameter whole on each rank, Muon's step local.
A step is `--grad_accum` micro-batches of forward and backward, `clip_grad_norm_` (train.py's default 1.0), AdamW's
and Muon's steps and `zero_grad`; the Muon step (`muon.step()`) is timed on its own inside it. Each timing is the
slowest rank's (an all-reduce MAX after a barrier). Warm-up steps first, then the sides alternate in trials (the
order flipped every trial) so that a machine busy with other jobs slows both alike; medians are printed, with the
bytes each rank gathers for Muon per step (every matrix whole, in fp32). Timing: run it on a quiet machine.
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
from training.optimizers.plan import build_optimizer, plan_optimizers
from training.optimizers.spec import BLOCK_MATRICES, claimed_names

GRAD_CLIP = TrainingConfig().grad_clip  # train.py's default
SIDES = ("fsdp2", "ddp")


def build_side(side: str, config: GPTConfig, device: torch.device) -> tuple[torch.nn.Module, list]:
    torch.manual_seed(1337)  # the same initial weights on both sides and every rank
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
    return ddp, build_optimizer(model, plan_optimizers(OptimConfig(optimizer="muon"), ModelConfig()), device.type)


def slowest(seconds: float, device: torch.device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_step(model: torch.nn.Module, optimizers: list, batches: list[tuple[torch.Tensor, torch.Tensor]],
             device: torch.device) -> tuple[float, float]:
    """(the whole step's seconds, the Muon step's), this rank's."""
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
    parser.add_argument("--json", help="also write the figures to this file (rank 0)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                       dropout=0.0)
    sides = {side: build_side(side, config, device) for side in SIDES}
    g = torch.Generator().manual_seed(rank)  # each rank its own share of the batch, the same for both sides
    batches = [(torch.randint(0, config.vocab_size, (args.micro_batch_size, args.block_size), generator=g).to(device),
                torch.randint(0, config.vocab_size, (args.micro_batch_size, args.block_size), generator=g).to(device))
               for _ in range(args.grad_accum)]

    times: dict[str, dict[str, list[float]]] = {side: {"step": [], "muon": []} for side in SIDES}
    for trial in range(args.warmup + args.trials):
        order = SIDES if trial % 2 == 0 else SIDES[::-1]
        for side in order:
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
              f"{args.trials} trials, medians of the slowest rank")
        print(f"Muon gathers {4 * args.n_layer} matrices whole per step under FSDP2: {gathered / 2 ** 20:.2f} MiB "
              "a rank (fp32)")
        for side in SIDES:
            print(f"{side:6s}  whole step {medians[side]['step'] * 1e3:9.1f} ms   Muon step "
                  f"{medians[side]['muon'] * 1e3:9.1f} ms")
        print(f"fsdp2 / ddp: whole step x{medians['fsdp2']['step'] / medians['ddp']['step']:.2f}, Muon step "
              f"x{medians['fsdp2']['muon'] / medians['ddp']['muon']:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "world": world, "gathered_bytes": gathered, "medians": medians,
                           "times": times}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
