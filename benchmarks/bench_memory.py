"""Peak memory and time of one training step: chunked loss or plain (full logits), activation checkpointing on or off.

    python -m benchmarks.bench_memory                       # GPT-2 124M, micro-batch 8 x 1024, CPU, all four
    python -m benchmarks.bench_memory --loss chunked --repeats 2   # activation checkpointing off/on, paired, twice
    python -m benchmarks.bench_memory --model tiny --micro_batch_size 4

Each measurement runs in its own subprocess (one `--loss chunked|plain` and `--activation_checkpointing on|off`),
so that its peak RSS (ru_maxrss) is the step's alone and not the high-water mark of an earlier one. The step:
forward and backward in training mode, fp32, then an AdamW step (its two state tensors count too). "plain" is the
full logits' path (`GPT.loss_chunk_rows = 0`: F.cross_entropy over the full padded logits, what `GPT.forward` computed
before the chunked loss), "chunked" the CPU's default, 512-row chunks.
"on" sets `GPT.activation_checkpointing` (what `--activation_checkpointing` does in train.py). With `--repeats N`
the settings take turns N times (A, B, A, B), so a load that changes over time falls on both alike. Each process
first sets the CPU allocator as train.py does (glibc's mmap and trim thresholds, huge pages for large tensors;
`--malloc default` keeps glibc's and torch's own, which retain freed activation memory: see
training.distributed.processes.return_freed_memory_to_the_os).
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import torch

from common.cli import CliParser
from common.errors import run_cli
from model import GPT, GPTConfig
from training.distributed.processes import return_freed_memory_to_the_os, use_transparent_huge_pages


def one_step(size: str, micro_batch_size: int, loss: str, activation_checkpointing: str, malloc: str) -> None:
    if malloc == "train":
        assert return_freed_memory_to_the_os(), "not glibc: --malloc train changes nothing here"
        use_transparent_huge_pages()  # before the first tensor, as in train.py
    torch.manual_seed(0)
    gpt = GPT(GPTConfig.from_name(size)).train()
    gpt.loss_chunk_rows = 0 if loss == "plain" else None  # None: the CPU's default, the chunked loss
    gpt.activation_checkpointing = activation_checkpointing == "on"
    T = gpt.config.block_size
    x, y = torch.randint(0, gpt.config.vocab_size, (2, micro_batch_size, T))
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-4)
    rss_model = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    t0, c0 = time.perf_counter(), time.process_time()
    _, value = gpt(x, y)
    value.backward()
    rss_backward = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    optimizer.step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{loss:<8} activation checkpointing {activation_checkpointing:<3} | malloc {malloc:<7} | "
          f"{micro_batch_size} x {T} tokens | "
          f"peak RSS {peak:.2f} GiB (building the model {rss_model:.2f}, to the backward's end "
          f"{rss_backward:.2f}) | step {wall:.1f} s wall, {cpu:.1f} s CPU | loss {value.item():.4f} | "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)


def main() -> None:
    parser = CliParser(prog="python -m benchmarks.bench_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help="size preset: gpt2, small, mini, tiny, ...")
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--loss", choices=("both", "chunked", "plain"), default="both",
                        help="both: one subprocess for each")
    parser.add_argument("--activation_checkpointing", choices=("both", "off", "on"), default="both",
                        help="both: one subprocess for each")
    parser.add_argument("--malloc", choices=("train", "default"), default="train",
                        help="train: the CPU allocator's settings of train.py (training.distributed.processes: glibc's "
                             "thresholds, huge pages); default: glibc's and torch's own")
    parser.add_argument("--repeats", type=int, default=1, help="measure every setting this many times, in turns")
    args = parser.parse_args()
    if args.loss != "both" and args.activation_checkpointing != "both" and args.repeats == 1:
        return one_step(args.model, args.micro_batch_size, args.loss, args.activation_checkpointing, args.malloc)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, CPU")
    losses = ("plain", "chunked") if args.loss == "both" else (args.loss,)
    recompute = ("off", "on") if args.activation_checkpointing == "both" else (args.activation_checkpointing,)
    for _ in range(args.repeats):
        for loss in losses:
            for ac in recompute:
                subprocess.run([sys.executable, "-m", "benchmarks.bench_memory", "--model", args.model,
                                "--micro_batch_size", str(args.micro_batch_size), "--loss", loss,
                                "--activation_checkpointing", ac, "--malloc", args.malloc], check=True)


if __name__ == "__main__":
    run_cli(main)
