"""HellaSwag scoring throughput (items/s): batched vs one item (4 endings) per forward pass.

    python -m benchmarks.bench_hellaswag [--model tiny|gpt2|<spec>] [--limit 200]
        [--batch_sizes 1,16] [--device cpu|cuda] [--dtype auto|bf16|fp32] [--json results.json]

--model: a GPTConfig size name (`tiny`, `gpt2`, ... : random weights, speed only) or anything
GPT.from_pretrained accepts. Data: the approximate offline copy of the 10,042 validation items in
../shared/assets (or --data). Each batch size is run once to warm up (on 32 items), then timed.
What is timed is `evaluate_hellaswag`, the trainer's evaluation; without the `evaluate` package (the GPU
device image has none) it is `item_loglikelihoods`, the same forward passes minus the accuracy metric,
and the accuracies are reported as None.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from eval.hellaswag import evaluate_hellaswag, item_loglikelihoods, load_items
from model import GPT, GPTConfig

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "assets" / "hellaswag_val_approx.jsonl.gz"
SIZE_NAMES = ("tiny", "mini", "small", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def build_model(spec: str, device: str) -> GPT:
    if spec in SIZE_NAMES:
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_name(spec))
    else:
        model = GPT.from_pretrained(spec)
    return model.to(device)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--limit", type=int, default=200, help="items to time (0: all)")
    parser.add_argument("--batch_sizes", default="1,16", help="items per forward, comma-separated")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    parser.add_argument("--json",
                        help="also write the figures to this JSON file (benchmarks/gpu_acceptance.py reads it)")
    args = parser.parse_args()

    items = load_items(args.data, args.limit or None)
    model = build_model(args.model, args.device)
    bf16 = {"auto": None, "bf16": True, "fp32": False}[args.dtype]
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"CPU, {torch.get_num_threads()} threads"
    print(f"model {args.model} ({model.num_params() / 1e6:.1f}M non-embedding params), "
          f"{len(items)} items, {name}, torch {torch.__version__}, dtype {args.dtype}")
    try:
        import evaluate  # noqa: F401
        with_metric = True
    except ImportError:
        with_metric = False
    if not with_metric:
        print("no `evaluate` package: timing item_loglikelihoods (the same forward passes), no accuracies")

    def score(some_items, batch_size):
        if with_metric:
            return evaluate_hellaswag(model, some_items, batch_size=batch_size, bf16=bf16)
        item_loglikelihoods(model, some_items, batch_size=batch_size, bf16=bf16)
        return {"acc": None, "acc_norm": None}

    base = None
    runs = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        score(items[:32], batch_size)  # warm-up
        sync(args.device)
        start = time.perf_counter()
        result = score(items, batch_size)
        sync(args.device)
        seconds = time.perf_counter() - start
        rate = len(items) / seconds
        base = base or rate
        accs = "acc n/a" if result["acc"] is None else f"acc {result['acc']:.4f} acc_norm {result['acc_norm']:.4f}"
        print(f"batch_size {batch_size:>3} items/forward: {rate:9.1f} items/s  ({rate / base:4.1f}x)  "
              f"full 10,042-item set in {10042 / rate:7.1f} s  {accs}", flush=True)
        runs.append({"batch_size": batch_size, "seconds": seconds, "items_per_s": rate,
                     "full_set_s": 10042 / rate, "acc": result["acc"], "acc_norm": result["acc_norm"]})
        if args.json:  # after every batch size: a run stopped at a time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "items": len(items), "device": name, "dtype": args.dtype,
                           "with_metric": with_metric, "torch": torch.__version__, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
