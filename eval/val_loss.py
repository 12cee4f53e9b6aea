"""Mean next-token loss on a fixed validation token array, split across ranks and reduced exactly.

The array is cut into windows of block_size + 1 tokens stepping by block_size (inputs and their
shifted targets, so no target token is scored twice); window i goes to rank i % world. Every rank
sums its token losses and counts; the sums are added over ranks, so the result is the same mean
for any world size and batch size (up to float summation order). Prompt/completion data is scored
as it is trained: one padded row per held-out example, only completion tokens and their EOT counted.

Usage: python -m eval.val_loss --model <Hub id | HF folder | checkpoint | run> \
           [--dataset shakespeare] [--max_tokens 1000000] [--block_size N] [--batch_size 8]

For one of our runs (its folder, final/ or a checkpoint), what the flags leave out comes from the run's
config.yaml (dataset, val_tokens, block_size, eval_batch_size): the result is the val_loss the run
logged with those weights, exactly on CPU in fp32.
"""
from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any, Sequence

import numpy as np
import torch

from checkpoint_io.weights import Weights, resolve_weights
from common.cli import CliParser
from common.console import TerminalBar
from common.errors import UserError, run_cli
from common.run_dir import RunDir
from data.pairs import PairExamples
from data.settings import DataConfig, check_val_tokens, count_windows, require_a_window
from data.source import open_source
from data.tokenizer import IGNORE
from eval.common import (
    autocast,
    cli_accelerator,
    eval_mode,
    load_model,
    model_block_size,
    model_device,
    pick_device,
    rank_and_world,
    reduce_sum,
    require_known_tokens,
    steps_per_rank,
)

__all__ = ["evaluate_loss"]


def evaluate_loss(model: torch.nn.Module, tokens: np.ndarray | Sequence[int] | torch.Tensor | PairExamples, *,
                  block_size: int, batch_size: int, accelerator: Any | None = None,
                  bf16: bool | None = None) -> float:
    """Mean loss over every target token of the full windows in `tokens` (same on every rank); for
    prompt/completion examples (`data.pairs.PairExamples`), over their completion tokens and EOTs only
    (one padded row per example, masked as in training).

    Call on every rank with the same tokens: each rank runs the same number of forward passes
    (padding batches score nothing), as FSDP requires. bf16: autocast (default: on CUDA only).
    """
    if block_size < 1 or batch_size < 1:
        raise UserError(f"block_size and batch_size must be positive, got {block_size}, {batch_size}")
    limit = model_block_size(model)
    if limit is not None and block_size > limit:
        raise UserError(f"eval block_size {block_size} exceeds the model's block_size {limit}; "
                        f"use at most {limit}")
    if isinstance(tokens, PairExamples):
        examples = tokens
        examples.check_fits(block_size, "the validation examples")
        n_rows = len(examples)
        max_id = max((int(t.max()) for t in examples.tokens if len(t)), default=-1)

        def rows(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            return examples.rows(indices, block_size)
    else:
        stream = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
        require_a_window(len(stream), block_size, "use more validation tokens or a smaller block_size")
        n_rows = count_windows(len(stream), block_size)
        max_id = int(stream.max()) if len(stream) else -1

        def rows(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            windows = torch.stack([stream[i * block_size:(i + 1) * block_size + 1] for i in indices])
            return windows[:, :-1], windows[:, 1:]
    require_known_tokens(model, max_id, "the validation set")  # the same tokens on every rank: no collective
    rank, world = rank_and_world(accelerator)
    mine = list(range(rank, n_rows, world))
    device = model_device(model)
    loss_sum = torch.zeros((), dtype=torch.float64)
    count = 0
    with eval_mode(model):
        # A bar on the main process's terminal: long validation sets take a while, and the user should see why.
        for step in TerminalBar(range(steps_per_rank(n_rows, world, batch_size)), show=rank == 0,
                                desc="validation loss", unit="batch", leave=False, dynamic_ncols=True):
            batch = mine[step * batch_size:(step + 1) * batch_size]
            # Fixed shape (batch_size, block_size): rows past the end are padding with no targets.
            x = torch.zeros(batch_size, block_size, dtype=torch.long)
            y = torch.full((batch_size, block_size), IGNORE, dtype=torch.long)
            if batch:
                x[:len(batch)], y[:len(batch)] = rows(batch)
            count += int((y != IGNORE).sum())
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device, bf16):
                _, loss = model(x, y, loss_reduction="sum")
            loss_sum += loss.double().cpu()
    totals = reduce_sum(torch.stack([loss_sum, torch.tensor(float(count), dtype=torch.float64)]),
                        accelerator)
    return (totals[0] / totals[1]).item()


# This CLI's settings, the run config fields they default to for a run, and their defaults otherwise: the data
# flags are a run's own (same names, defaults from data.settings); --max_tokens is the run's val_tokens, but
# scores up to 1,000,000 tokens by default.
_DATA_FLAGS = tuple(f.name for f in fields(DataConfig) if f.name != "val_tokens")
_RUN_FIELDS = {**{name: name for name in _DATA_FLAGS}, "max_tokens": "val_tokens", "block_size": "block_size",
               "batch_size": "eval_batch_size"}
_DEFAULTS = {**{name: getattr(DataConfig, name) for name in _DATA_FLAGS}, "max_tokens": 1_000_000,
             "block_size": None, "batch_size": 8}


def settings(args: argparse.Namespace, weights: Weights) -> tuple[dict[str, Any], RunDir | None]:
    """The dataset, token count, block and batch size to score with: each flag the user passed, else the
    run's own (so the loss is the one the run logged: the same windows in the same batches), else the
    defaults. Returns them and the run they came from (None when the weights are not a run's, or the run
    has no config.yaml)."""
    from configs import read_run_config  # here: scoring a model from Python needs no config schema

    run = weights.run if weights.run is not None and weights.run.config_file.is_file() else None
    recorded = read_run_config(run.config_file) if run is not None else {}
    chosen = {}
    for name, default in _DEFAULTS.items():
        given = getattr(args, name)
        chosen[name] = given if given is not None else recorded.get(_RUN_FIELDS[name], default)
    return chosen, run


def main(argv: Sequence[str] | None = None) -> float:
    parser = CliParser(prog="python -m eval.val_loss", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="Hub id, HF GPT-2 folder, our checkpoint folder or run folder")
    run_default = "default: the run's --{} when --model is one of our runs, else {}"
    parser.add_argument("--dataset", default=None,
                        help="shakespeare, a local file/folder, prepared shards or a Hub dataset id; "
                             + run_default.format("dataset", _DEFAULTS["dataset"]))
    parser.add_argument("--dataset_config", default=None,
                        help="Hub dataset config name; " + run_default.format("dataset_config", "none"))
    parser.add_argument("--text_column", default=None, help=run_default.format("text_column", _DEFAULTS["text_column"]))
    parser.add_argument("--prompt_field", default=None, help="prompt field of prompt/completion .jsonl data; "
                        + run_default.format("prompt_field", _DEFAULTS["prompt_field"]))
    parser.add_argument("--completion_field", default=None, help="completion field of prompt/completion .jsonl "
                        "data; " + run_default.format("completion_field", _DEFAULTS["completion_field"]))
    parser.add_argument("--max_tokens", type=int, default=None,
                        help="validation tokens to score; " + run_default.format("val_tokens", _DEFAULTS["max_tokens"]))
    parser.add_argument("--block_size", type=int, default=None, help=run_default.format("block_size", "the model's"))
    parser.add_argument("--batch_size", type=int, default=None,
                        help="windows per forward pass; " + run_default.format("eval_batch_size", "8"))
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (single process); default: "
                                                       "the accelerator's")
    args = parser.parse_args(argv)
    weights = resolve_weights(args.model)  # once: the run's settings and the model both come from it
    chosen, run = settings(args, weights)
    source = open_source(DataConfig(**{name: chosen[name] for name in _DATA_FLAGS}, val_tokens=chosen["max_tokens"]))
    with cli_accelerator(cpu=args.device == "cpu", command="python -m eval.val_loss") as accelerator:
        model = load_model(weights, pick_device(args.device, accelerator))
        source.check_vocab(model.config.vocab_size, f"--model {args.model}")  # before any of its data is read
        block_size = chosen["block_size"] or model_block_size(model)
        check_val_tokens(chosen["max_tokens"], block_size, flag="--max_tokens")
        tokens = source.val_set(block_size)
        loss = evaluate_loss(model, tokens, block_size=block_size, batch_size=chosen["batch_size"],
                             accelerator=accelerator)
        if accelerator.is_main_process:
            n = (tokens.n_targets() if isinstance(tokens, PairExamples)
                 else (len(tokens) - 1) // block_size * block_size)
            source = f", settings from {run.config_file}" if run is not None else ""
            print(f"val_loss {loss:.6f}  ppl {np.exp(loss):.2f}  ({n} target tokens, "
                  f"block_size {block_size}, dataset {chosen['dataset']}{source})", flush=True)
    return loss


if __name__ == "__main__":
    run_cli(main)
