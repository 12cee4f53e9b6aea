"""Data pipeline throughput, next to what a GPT-2 124M run consumes (~500k tokens/s on one H100).

    python -m benchmarks.bench_data [--parquet PATH] [--repeat 8]

Measures, in tokens per second: tokenization with 1 thread and with all cores, `data.prepare`
end to end (read parquet, tokenize, write shards), the shard loader's `next_batch` (B=16, T=1024,
shuffled reads from np.memmap), and the streaming loader (datasets streaming over local parquet,
tokenizing as it goes). Uses the FineWeb sample in ../shared/assets by default.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from data.tokens import default_threads, encode_documents

GPT2_124M_H100_TOKENS_PER_S = 500_000
DEFAULT_PARQUET = Path(__file__).resolve().parents[2] / "shared" / "assets" / "fineweb_sample_100docs.parquet"


def _rate(label: str, tokens: int, seconds: float) -> float:
    rate = tokens / seconds
    print(f"{label:<46} {rate / 1e6:8.2f} M tok/s  ({rate / GPT2_124M_H100_TOKENS_PER_S:6.1f}x a 124M H100 run)")
    return rate


def bench_tokenize(docs: list[str], threads: int) -> float:
    encode_documents(docs[:10], threads)  # warm up the tokenizer (built once per process)
    t0 = time.perf_counter()
    tokens = encode_documents(docs, threads)
    return _rate(f"tokenize, {threads} thread(s)", len(tokens), time.perf_counter() - t0)


def bench_prepare(parquet: Path, out: Path, threads: int) -> float:
    from data.prepare import prepare

    t0 = time.perf_counter()
    m = prepare(str(parquet), out, shard_tokens=500_000, val_tokens=10_000, num_threads=threads, progress=False)
    total = m["total_train_tokens"] + m["total_val_tokens"]
    return _rate(f"data.prepare end to end, {threads} thread(s)", total, time.perf_counter() - t0)


def bench_loader(loader, label: str, batches: int) -> float:
    loader.next_batch()
    t0 = time.perf_counter()
    for _ in range(batches):
        x, _ = loader.next_batch()
    return _rate(label, batches * x.numel(), time.perf_counter() - t0)


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parquet", type=Path, default=DEFAULT_PARQUET)
    parser.add_argument("--repeat", type=int, default=8, help="copies of the sample, for steadier timings")
    args = parser.parse_args()
    table = pq.read_table(args.parquet)
    big = pa.concat_tables([table] * args.repeat)
    docs = big.column("text").to_pylist()
    all_threads = default_threads()
    print(f"{len(docs)} documents ({args.repeat} x {args.parquet.name}), {all_threads} cores")
    print(f"consumption of GPT-2 124M on one H100: ~{GPT2_124M_H100_TOKENS_PER_S / 1e6:.2f} M tok/s")
    bench_tokenize(docs, 1)
    bench_tokenize(docs, all_threads)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "corpus.parquet"
        pq.write_table(big, src, row_group_size=100)
        bench_prepare(src, Path(tmp) / "shards1", 1)
        bench_prepare(src, Path(tmp) / "shards", all_threads)

        from data.settings import DataConfig
        from data.source import open_source
        from data.streaming import StreamingLoader, open_hub_stream

        shard_loader = open_source(DataConfig(dataset=str(Path(tmp) / "shards"))).train_loader(
            block_size=1024, micro_batch_size=16, rank=0, world_size=1, seed=0)
        bench_loader(shard_loader, "shard loader next_batch (B=16, T=1024)", 200)
        stream = StreamingLoader(open_hub_stream("parquet", None, "train", data_files=str(src)), block_size=1024,
                                 micro_batch_size=16, rank=0, world_size=1, val_docs=10)
        bench_loader(stream, "streaming loader (parquet, tokenizing), 1 rank", 60)


if __name__ == "__main__":
    main()
