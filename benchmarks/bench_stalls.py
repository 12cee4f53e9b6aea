"""How much of a run's wall time is spent waiting for data, when the step leaves the CPU free as a GPU step does.

    python -m benchmarks.bench_stalls [--demands 0.1,0.25,0.5,1.0] [--processes 1,2] [--micro_batch 64]

The loop of train.py with its step replaced by a sleep (the CPU and the GIL free, as while a GPU computes): each
step takes one micro-batch (by default 64 x 1024 tokens, GPT-2 124M's on an H100) from the real loader, timed as
train.py times it (`RunClock`'s data phase), then sleeps for the step. The step's length sets the demand: a
fraction of this machine's single-core tokenization rate R (measured first, on the same documents), per rank. Sources:
- `stream`: a local parquet (the FineWeb sample, repeated) streamed through `datasets`, as a Hub dataset is, with
  the documents read and encoded ahead of the step (`prefetch`) and when the step needs them (`inline`, before);
- `shards`: token shards written by `data.prepare` (memory-mapped; nothing to encode);
- `text`: the embedded Tiny Shakespeare (encoded once when the source opens);
- `floor`: a batch already made, handed back as tensors: nothing read, encoded or cut. What it waits is what any
  Python code pays right after the sleeping step on this machine (its caches taken by other work meanwhile), the
  floor under every other row.
Each rank is its own process (LOCAL_WORLD_SIZE set, so a rank encodes on its share of the cores, as under
`accelerate launch`); the figure is the slowest rank's data wait over the wall time of its loop, after the first
batch (the source opening, paid once per run). Timing: run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

BLOCK = 1024
DEFAULT_PARQUET = Path(__file__).resolve().parents[2] / "shared" / "assets" / "fineweb_sample_100docs.parquet"
VAL_DOCS = 10  # of the sample's 100 documents held out; the stream repeats the other 90 (each rank its share)


def single_core_rate(parquet: Path) -> float:
    """Tokens per second that one thread encodes the sample's documents at (the best of 3)."""
    import pyarrow.parquet as pq

    from data.tokens import encode_documents

    docs = pq.read_table(parquet).column("text").to_pylist()
    encode_documents(docs[:10], 1)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        tokens = len(encode_documents(docs, 1))
        best = max(best, tokens / (time.perf_counter() - start))
    return best


class ReadyBatch:
    """The `floor` source: one batch made up front, handed back as train.py's loaders hand theirs."""

    def __init__(self, micro_batch: int) -> None:
        import numpy as np

        self.rows = np.zeros((micro_batch, BLOCK + 1), dtype=np.int64)

    def next_batch(self):
        import torch

        rows = torch.from_numpy(self.rows)
        return rows[:, :-1], rows[:, 1:]

    def close(self) -> None:
        pass


def open_loader(source: str, files: list[str], shards: Path, rank: int, world: int, micro_batch: int):
    if source == "floor":
        return ReadyBatch(micro_batch)
    if source in ("stream", "inline"):
        from data.streaming import PREFETCH_BATCHES, StreamingLoader, open_hub_stream

        return StreamingLoader(open_hub_stream("parquet", None, "train", data_files=files), block_size=BLOCK,
                               micro_batch_size=micro_batch, rank=rank, world_size=world, val_docs=VAL_DOCS,
                               prefetch=PREFETCH_BATCHES if source == "stream" else 0)
    from data.settings import DataConfig
    from data.source import open_source

    dataset = str(shards) if source == "shards" else DataConfig().dataset
    return open_source(DataConfig(dataset=dataset)).train_loader(block_size=BLOCK, micro_batch_size=micro_batch,
                                                                rank=rank, world_size=world, seed=0)


def one_rank(source: str, files: list[str], shards: Path, rank: int, world: int, micro_batch: int, step_s: float,
             steps: int, results) -> None:
    """The loop of one rank: `steps` steps of `step_s` seconds each after the first batch; puts its wait share."""
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    from training.timing import DATA, RunClock

    loader = open_loader(source, files, shards, rank, world, micro_batch)
    loader.next_batch()  # the source's first batch: paid once per run, not a stall of the loop
    clock = RunClock()
    for _ in range(steps):
        with clock.phase(DATA):
            loader.next_batch()
        time.sleep(step_s)  # the step: the CPU and the GIL free
    wall = time.perf_counter() - clock.start
    loader.close()
    results.put(clock.total[DATA] / wall)


def measure(source: str, files: list[str], shards: Path, world: int, micro_batch: int, step_s: float,
            steps: int) -> float:
    """The slowest rank's data wait over its loop's wall time, `world` ranks at once."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=one_rank,
                             args=(source, files, shards, r, world, micro_batch, step_s, steps, results))
             for r in range(world)]
    for p in ranks:
        p.start()
    shares = [results.get() for _ in ranks]
    for p in ranks:
        p.join()
    return max(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parquet", type=Path, default=DEFAULT_PARQUET)
    parser.add_argument("--demands", default="0.1,0.25,0.5,1.0", help="per rank, as fractions of the single-core "
                        "tokenization rate")
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--sources", default="inline,stream,shards,text,floor")
    parser.add_argument("--micro_batch", type=int, default=64, help="sequences of 1024 tokens per step and rank")
    parser.add_argument("--tokens", type=int, default=2_500_000, help="tokens each rank takes per figure")
    args = parser.parse_args()
    demands = [float(d) for d in args.demands.split(",")]
    worlds = [int(w) for w in args.processes.split(",")]
    rate = single_core_rate(args.parquet)
    print(f"single-core tokenization rate R = {rate / 1e6:.2f} M tok/s ({os.cpu_count()} cores); step = "
          f"{args.micro_batch} x {BLOCK} tokens per rank; data wait as a share of the loop's wall time (slowest rank)")
    with tempfile.TemporaryDirectory() as tmp:
        files = [str(args.parquet)]
        shards = Path(tmp) / "shards"
        if "shards" in args.sources:
            from data.prepare import prepare

            prepare(str(args.parquet), shards, shard_tokens=500_000, val_tokens=10_000, progress=False)
        print("| source | processes | " + " | ".join(f"{d:.0%} of R" for d in demands) + " |")
        print("|---|---|" + "---|" * len(demands))
        for source in args.sources.split(","):
            for world in worlds:
                cells = []
                for demand in demands:
                    batch_tokens = args.micro_batch * BLOCK
                    step_s = batch_tokens / (demand * rate)
                    steps = max(20, args.tokens // batch_tokens)
                    cells.append(f"{measure(source, files, shards, world, args.micro_batch, step_s, steps):.1%}")
                label = {"inline": "stream, inline (before)", "stream": "stream, prefetch",
                         "floor": "floor (a batch already made)"}.get(source, source)
                print(f"| {label} | {world} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
