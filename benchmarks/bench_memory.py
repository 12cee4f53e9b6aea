"""Peak memory of one training step with the chunked loss and with the plain one (full logits).

    python -m benchmarks.bench_memory                       # GPT-2 124M, micro-batch 8 x 1024, CPU
    python -m benchmarks.bench_memory --model tiny --micro_batch_size 4

Each measurement runs in its own subprocess (`--loss chunked|plain`), so that its peak RSS (ru_maxrss)
is the step's alone and not the high-water mark of an earlier one. The step: forward and backward in
training mode, fp32, then an AdamW step (its two state tensors count too). "plain" swaps the chunked loss
for F.cross_entropy over the full padded logits, which is what `GPT.forward` computed before it.
"""
from __future__ import annotations

import resource
import subprocess
import sys
import time

import torch
from torch.nn import functional as F

import model.gpt
from common.cli import CliParser
from common.errors import run_cli
from model import GPT, GPTConfig


def plain_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, n_valid: int,
                        reduction: str = "mean") -> torch.Tensor:
    """The loss before model/loss.py: full logits, a -inf bias on the padding columns."""
    bias = torch.zeros(weight.size(0), dtype=x.dtype)
    bias[n_valid:] = float("-inf")
    logits = F.linear(x, weight, bias)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction)


def one_step(size: str, micro_batch_size: int, loss: str) -> None:
    if loss == "plain":
        model.gpt.chunked_cross_entropy = plain_cross_entropy
    torch.manual_seed(0)
    gpt = GPT(GPTConfig.from_name(size)).train()
    T = gpt.config.block_size
    x, y = torch.randint(0, gpt.config.vocab_size, (2, micro_batch_size, T))
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-4)
    rss_model = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    t0, c0 = time.perf_counter(), time.process_time()
    _, value = gpt(x, y)
    value.backward()
    optimizer.step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{loss:<8} {micro_batch_size} x {T} tokens | peak RSS {peak:.2f} GiB (after building the model "
          f"{rss_model:.2f}) | step {wall:.1f} s wall, {cpu:.1f} s CPU | loss {value.item():.4f}", flush=True)


def main() -> None:
    parser = CliParser(prog="python -m benchmarks.bench_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help="size preset: gpt2, small, mini, tiny, ...")
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--loss", choices=("both", "chunked", "plain"), default="both",
                        help="both: one subprocess for each")
    args = parser.parse_args()
    if args.loss != "both":
        return one_step(args.model, args.micro_batch_size, args.loss)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, CPU")
    for loss in ("plain", "chunked"):
        subprocess.run([sys.executable, "-m", "benchmarks.bench_memory", "--model", args.model,
                        "--micro_batch_size", str(args.micro_batch_size), "--loss", loss], check=True)


if __name__ == "__main__":
    run_cli(main)
