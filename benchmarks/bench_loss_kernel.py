"""The loss kernel alone on a GPU: model.loss_kernel's Triton pass over one micro-batch's bf16 logits at each block
size and warp count, against the bytes it moves (two reads and one write) and a clone's bandwidth; and the compiled
full-logits loss (forward and backward) over the same logits beside it. Medians of 10 calls (CUDA events).

    python -m benchmarks.bench_loss_kernel [--rows 65536] [--vocab 50304]

One H200, 2026-11-28: docs/benchmarks.md ("The loss kernel").
"""
from __future__ import annotations

import argparse
import itertools

import torch
from torch.nn import functional as F

from data.tokenizer import IGNORE


def timed(fn, reps: int = 10) -> float:
    """Median milliseconds of `fn` over `reps` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--n_valid", type=int, default=50257)
    args = p.parse_args()
    from model import loss_kernel  # imports Triton: only once the arguments are read

    logits = torch.randn(args.rows, args.vocab, device="cuda", dtype=torch.bfloat16) * 3
    targets = torch.randint(0, args.n_valid, (args.rows,), device="cuda")
    losses = torch.empty(args.rows, device="cuda", dtype=torch.float32)
    gbytes = 3 * logits.numel() * logits.element_size() / 1e9  # two reads, one write
    copy = timed(lambda: logits.clone())
    print(f"{args.rows} x {args.vocab} bf16 ({logits.numel() * 2 / 1e9:.2f} GB); clone {copy:.2f} ms "
          f"({2 * logits.numel() * 2 / 1e9 / copy:.2f} TB/s)")
    for block, warps in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):
        def run(block=block, warps=warps):
            loss_kernel._loss_and_grad_rows[(args.rows,)](logits, logits.stride(0), targets, losses, args.n_valid,
                                                          args.vocab, IGNORE_ID=IGNORE, BLOCK=block, num_warps=warps)
        try:
            ms = timed(run)
        except Exception as e:  # a configuration the compiler refuses
            print(f"BLOCK {block:5d} warps {warps:2d}: {type(e).__name__}")
            continue
        print(f"BLOCK {block:5d} warps {warps:2d}: {ms:6.2f} ms  {gbytes / ms:.2f} TB/s at 3 passes")

    bias = torch.zeros(args.vocab, device="cuda", dtype=torch.bfloat16)
    bias[args.n_valid:] = float("-inf")
    leaf = logits.detach().requires_grad_()

    @torch.compile
    def full(lg):
        return F.cross_entropy((lg + bias).float(), targets, ignore_index=IGNORE)

    def fwd_bwd():
        full(leaf).backward()
    print(f"compiled full-logits loss, forward and backward: {timed(fwd_bwd):.2f} ms")


if __name__ == "__main__":
    main()
