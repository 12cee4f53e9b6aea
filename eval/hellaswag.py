"""HellaSwag zero-shot accuracy, batched and distributed, scored like lm-evaluation-harness.

Each ending is scored as a continuation of the context: the sum of its tokens' log-probabilities.
Three accuracies (fraction of items whose highest-scoring ending is the labelled one), defined
once, in the `evaluate` metric eval/metrics/hellaswag_acc, which the main process runs on every
item's log-likelihoods, ending lengths and label:
- acc: raw sum of log-likelihoods (harness `acc`).
- acc_norm: log-likelihood / len(ending) in characters (harness `acc_norm`).
- acc_norm_tokens: log-likelihood / number of ending tokens, i.e. lowest mean token loss (the
  variant of build-nanogpt / llm.c, here on the harness's prompt).
Needs the `evaluate` package: imported by evaluate_hellaswag on the main process only, not on import.

Usage: python -m eval.hellaswag --model gpt2 [--data hellaswag_val.jsonl] [--limit N]
       [--output results.json] [--batch_size 16] [--device cuda]
Several GPUs: accelerate launch -m eval.hellaswag --model ...
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from common.cli import CliParser
from common.console import TerminalBar
from common.errors import UserError, run_cli
from data.tokenizer import IGNORE
from eval.common import (
    autocast,
    broadcast_from_main,
    cli_accelerator,
    eval_mode,
    gather_rows,
    load_model,
    model_block_size,
    model_device,
    pick_device,
    rank_and_world,
    require_known_tokens,
    steps_per_rank,
)
from eval.hellaswag_data import N_ENDINGS, load_items, preprocess, query_and_choices

__all__ = ["encode_items", "evaluate_hellaswag", "item_loglikelihoods", "load_items", "preprocess",
           "require_metric_packages"]

METRICS = ("acc", "acc_norm", "acc_norm_tokens")
METRIC_DIR = Path(__file__).resolve().parent / "metrics" / "hellaswag_acc"  # absolute: any cwd
PAD_MULTIPLE = 16  # sequence lengths are rounded up to this: few distinct shapes for compiled models


@dataclass
class Encoded:
    """One item as token rows: for each ending, the full sequence and how many of its last tokens
    are the ending; plus character lengths of the endings and the label."""

    rows: list[list[int]]
    n_cont: list[int]
    choice_chars: list[int]
    label: int


def encode_items(items: Sequence[dict[str, Any]], enc: Any, block_size: int | None) -> list[Encoded]:
    """Tokens of each item's four (context, " " + ending) requests, split as the harness does.

    lm_eval/api/model.py, TemplateLM._encode_pair: trailing spaces of the context move to the
    continuation, context + continuation is encoded once, and the continuation is what follows
    the len(encode(context)) first tokens; the model then reads encode(context) + continuation,
    cut on the left to block_size + 1 tokens if longer. The target delimiter is " " (harness
    default for multiple-choice tasks). One batched encode call (tiktoken threads) for speed.
    """
    texts, prepared = [], []
    for item in items:
        query, choices = query_and_choices(item)
        context = query.rstrip()
        texts += [context] + [query + " " + choice for choice in choices]
        prepared.append(choices)
    tokens = enc.encode_ordinary_batch(texts)
    stride, out = N_ENDINGS + 1, []
    for k, choices in enumerate(prepared):
        context_tokens, wholes = tokens[stride * k], tokens[stride * k + 1:stride * (k + 1)]
        rows, n_cont = [], []
        for whole in wholes:
            cont_tokens = whole[len(context_tokens):]
            row = context_tokens + cont_tokens
            row = row[-(block_size + 1):] if block_size is not None else row
            rows.append(row)
            n_cont.append(min(len(cont_tokens), len(row) - 1))
        # acc_norm divides by len(choice), the ending WITHOUT the leading delimiter: the
        # harness's ConfigurableTask.process_results has `completion_len = np.array([float(len(i))
        # for i in choices])` with choices = doc_to_choice(doc), while construct_requests adds
        # the delimiter separately, f"{target_delimiter}{cont}" (lm_eval/api/task.py).
        out.append(Encoded(rows, n_cont, [len(c) for c in choices], int(items[k]["label"])))
    return out


def _batches(encoded: Sequence[Encoded], batch_size: int) -> list[list[int]]:
    """Indices of items per batch, longest first so each batch pads little."""
    order = sorted(range(len(encoded)), key=lambda i: -max(len(r) for r in encoded[i].rows))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _forward(model: torch.nn.Module, encoded: Sequence[Encoded], batch: list[int], *,
             n_rows: int, block_size: int | None, device: torch.device,
             bf16: bool | None) -> torch.Tensor:
    """Log-likelihoods (len(batch), 4) of the endings: one forward on right-padded rows.

    Targets are -100 outside each ending, so padding (and the context) adds nothing; causal
    attention means padding on the right cannot change earlier positions. An empty `batch` is a
    padding batch that keeps this rank in step with the others."""
    rows = [(row, n) for i in batch for row, n in zip(encoded[i].rows, encoded[i].n_cont)]
    longest = max((len(row) - 1 for row, _ in rows), default=1)
    T = -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE
    T = min(T, block_size) if block_size else T
    x = torch.zeros(n_rows, T, dtype=torch.long)
    y = torch.full((n_rows, T), IGNORE, dtype=torch.long)
    for r, (row, n) in enumerate(rows):
        L = len(row) - 1
        x[r, :L] = torch.tensor(row[:-1])
        if n:
            y[r, L - n:L] = torch.tensor(row[-n:])
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    with autocast(device, bf16):
        _, loss = model(x, y, loss_reduction="none")  # 0 at ignored (-100) positions
    return -loss.float().sum(dim=1)[:len(rows)].view(-1, N_ENDINGS)


def _score(model: torch.nn.Module, encoded: Sequence[Encoded], *, batch_size: int,
           n_steps: int, bf16: bool | None, show_progress: bool) -> np.ndarray:
    """Log-likelihoods (len(encoded), 4), running exactly n_steps forward passes; with `show_progress`,
    a progress bar on a terminal (see common.console)."""
    device, block_size = model_device(model), model_block_size(model)
    lls = torch.zeros(len(encoded), N_ENDINGS, dtype=torch.float64)
    batches = _batches(encoded, batch_size)
    batches += [[] for _ in range(n_steps - len(batches))]
    with eval_mode(model):
        for batch in TerminalBar(batches, show=show_progress, desc="HellaSwag", unit="batch", leave=False,
                                 dynamic_ncols=True):
            out = _forward(model, encoded, batch, n_rows=batch_size * N_ENDINGS,
                           block_size=block_size, device=device, bf16=bf16)
            lls[batch] = out.double().cpu()
    return lls.numpy()


def _encode_all(items: Sequence[dict[str, Any]], model: torch.nn.Module) -> list[Encoded]:
    from data import get_tokenizer

    return encode_items(items, get_tokenizer(), model_block_size(model))


def _max_id(encoded: Sequence[Encoded]) -> int:
    """The largest token id of the encoded items (-1 for none)."""
    return max((max(row) for e in encoded for row in e.rows if row), default=-1)


def item_loglikelihoods(model: torch.nn.Module, items: Sequence[dict[str, Any]], *,
                        batch_size: int = 16, bf16: bool | None = None) -> np.ndarray:
    """Sum log-likelihood of each ending, shape (len(items), 4), on this process only."""
    encoded = _encode_all(items, model)
    require_known_tokens(model, _max_id(encoded), "the HellaSwag text")
    return _score(model, encoded, batch_size=batch_size,
                  n_steps=steps_per_rank(len(encoded), 1, batch_size), bf16=bf16, show_progress=True)


def require_metric_packages() -> None:
    """Raise UserError unless `evaluate`, which computes the HellaSwag accuracies, imports.

    For callers (the trainer) that want to fail at start-up rather than at the first evaluation.
    """
    try:
        import evaluate  # noqa: F401
    except ImportError as err:
        reason = " ".join(str(err).split())  # one line, whatever the import machinery said
        raise UserError(f"HellaSwag accuracies need the `evaluate` package, which cannot be imported "
                        f"({reason}); pip install evaluate") from err


def _accuracies(lls: np.ndarray, meta: np.ndarray) -> dict[str, float | int]:
    """{n, acc, acc_norm, acc_norm_tokens} from the eval/metrics/hellaswag_acc metric.

    lls: (n, 4) float64 log-likelihoods; meta: (n, 9) int64 rows [label, 4 ending lengths in
    characters, 4 ending token counts], as `_records` builds them. The caller has run
    `require_metric_packages`.
    """
    import evaluate

    # keep_in_memory: no Arrow cache files or locks under ~/.cache for a few thousand rows.
    metric = evaluate.load(str(METRIC_DIR), keep_in_memory=True)
    return metric.compute(predictions=lls.tolist(), references=meta[:, 0].tolist(),
                          choice_lengths=meta[:, 1:1 + N_ENDINGS].tolist(),
                          token_counts=meta[:, 1 + N_ENDINGS:].tolist())


def _records(lls: np.ndarray, encoded: Sequence[Encoded], n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's items as fixed-size tensors for the gather: log-likelihoods (n_rows, 4) float64
    and (n_rows, 9) int64 [label, ending chars, ending tokens]; rows past len(encoded) are zero."""
    scores = torch.zeros(n_rows, N_ENDINGS, dtype=torch.float64)
    scores[:len(encoded)] = torch.from_numpy(lls)
    meta = torch.zeros(n_rows, 1 + 2 * N_ENDINGS, dtype=torch.int64)
    for i, e in enumerate(encoded):
        meta[i] = torch.tensor([e.label, *e.choice_chars, *e.n_cont])
    return scores, meta


def _in_item_order(rows: torch.Tensor, world: int, n: int) -> torch.Tensor:
    """Gathered rows (world * per_rank, ...) back in item order, padding dropped.

    Rank r's j-th row is item r + j * world; rank r holds fewer than per_rank items only when
    r + j * world >= n, so after the transpose the padding rows are exactly those from n on."""
    per_rank = rows.shape[0] // world
    return rows.view(world, per_rank, -1).transpose(0, 1).reshape(world * per_rank, -1)[:n]


def evaluate_hellaswag(model: torch.nn.Module, items: Sequence[dict[str, Any]], *,
                       batch_size: int = 16, accelerator: Any | None = None,
                       bf16: bool | None = None) -> dict[str, float | int]:
    """HellaSwag accuracies of `model` over `items`, the same for any number of ranks.

    Call on every rank with the same items (e.g. from `load_items`). Rank r scores items
    i % world == r, `batch_size` items (4 * batch_size rows) per forward pass; every rank runs
    the same number of passes. The per-item records (float64 log-likelihoods, label, ending
    lengths in characters and tokens) are gathered bit-exact, the main process computes the
    accuracies with the eval/metrics/hellaswag_acc metric (only it imports `evaluate`) and
    broadcasts them. bf16: autocast to bfloat16 (default: on CUDA only).
    Returns {n, acc, acc_norm, acc_norm_tokens}, the same dict on every rank.
    """
    if batch_size < 1:
        raise UserError(f"batch_size must be at least 1, got {batch_size}")
    if not items:
        raise UserError("no HellaSwag items to evaluate; pass a non-empty item list")
    rank, world = rank_and_world(accelerator)
    if rank == 0:
        require_metric_packages()  # before scoring: a missing package should not cost a full pass
    encoded = _encode_all(items[rank::world], model)
    require_known_tokens(model, _max_id(encoded), "the HellaSwag text", accelerator)
    lls = _score(model, encoded, batch_size=batch_size, bf16=bf16,
                 n_steps=steps_per_rank(len(items), world, batch_size), show_progress=rank == 0)
    scores, meta = _records(lls, encoded, n_rows=-(-len(items) // world))  # rank 0 holds the most
    scores = _in_item_order(gather_rows(scores, accelerator), world, len(items))
    meta = _in_item_order(gather_rows(meta, accelerator), world, len(items))
    values = torch.zeros(1 + len(METRICS), dtype=torch.float64)
    if rank == 0:
        result = _accuracies(scores.numpy(), meta.numpy())
        values = torch.tensor([result["n"], *(result[m] for m in METRICS)], dtype=torch.float64)
    values = broadcast_from_main(values, accelerator).tolist()  # float64: exact, n < 2**53
    return {"n": int(values[0]), **dict(zip(METRICS, values[1:]))}


def _table(result: dict[str, Any]) -> str:
    lines = [f"HellaSwag  n={result['n']}  model={result['model']}", f"{'metric':<17}{'value':>8}"]
    lines += [f"{m:<17}{result[m]:>8.4f}" for m in METRICS]
    return "\n".join(lines)


def parser() -> CliParser:
    """The command line of `python -m eval.hellaswag`."""
    parser = CliParser(prog="python -m eval.hellaswag", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="Hub id, HF GPT-2 folder, our checkpoint folder or run folder")
    parser.add_argument("--data", default=None,
                        help="local HellaSwag .jsonl or .jsonl.gz (default: the Hub's Rowan/hellaswag validation)")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N items; default: all")
    parser.add_argument("--output", default=None, help="write the results as JSON here; default: print them only")
    parser.add_argument("--batch_size", type=int, default=16, help="items per forward pass")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:1, ... (single process); default: the accelerator's")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                        help="auto: bf16 autocast on CUDA, fp32 elsewhere")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)

    items = load_items(args.data, args.limit)  # before the model: bad data fails fast
    with cli_accelerator(cpu=args.device == "cpu", command="python -m eval.hellaswag") as accelerator:
        model = load_model(args.model, pick_device(args.device, accelerator))
        bf16 = {"auto": None, "bf16": True, "fp32": False}[args.dtype]
        start = time.perf_counter()
        result = evaluate_hellaswag(model, items, batch_size=args.batch_size,
                                    accelerator=accelerator, bf16=bf16)
        seconds = time.perf_counter() - start
        result = {"model": args.model, "data": args.data or "Rowan/hellaswag:validation", **result,
                  "world_size": accelerator.num_processes, "batch_size": args.batch_size,
                  "seconds": round(seconds, 3), "items_per_sec": round(result["n"] / seconds, 2)}
        if accelerator.is_main_process:
            print(_table(result), flush=True)
            if args.output:
                with open(args.output, "w", encoding="utf-8") as f:
                    json.dump(result, f, indent=2)
                    f.write("\n")
    return result


if __name__ == "__main__":
    run_cli(main)
