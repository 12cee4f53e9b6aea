"""Trainer-facing entry points: `build_train_loader` and `load_val_tokens`.

`dataset` is one of
- `shakespeare`: the embedded Tiny Shakespeare (first 90% of its tokens train, last 10% val);
- a folder of prepared token shards (has `manifest.json`, see `python -m data.prepare`);
- a local .txt/.jsonl/.parquet file, glob or folder, tokenized in memory (last 10% of tokens val);
- local .jsonl files of prompt/completion records (`data.pairs`: masked loss, last 10% of examples val);
- a Hub dataset id, optionally `id:config` (e.g. `HuggingFaceFW/fineweb-edu:sample-10BT`), streamed.

Each rank builds its own loader from (rank, world_size); loaders are never passed to
`accelerator.prepare` (which would re-split or dispatch the data through rank 0).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from data.local import local_tokens, looks_local
from data.pairs import PairExamples, PairsLoader, cap_tokens, is_pairs_dataset, read_pairs, split_pairs
from data.strided import StridedLoader
from data.tokens import TOKEN_DTYPE, TokenStream

SHAKESPEARE = "shakespeare"
SHAKESPEARE_FILE = Path(__file__).with_name("tinyshakespeare.txt")
TRAIN_FRACTION = 0.9  # in-memory corpora: the first 90% of tokens train, the rest is validation


class TrainLoader(Protocol):
    """What the trainer uses: endless per-rank batches and a resumable position. `masked_targets`: whether
    targets may be -100 (then the batches of a step differ in their number of targets, and the trainer
    normalises the loss by the global count; otherwise every position is a target)."""

    masked_targets: bool

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def source_kind(dataset: str) -> str:
    """`shakespeare`, `shards`, `local` or `hub`."""
    if dataset == SHAKESPEARE:
        return "shakespeare"
    if (Path(dataset).expanduser() / "manifest.json").is_file():
        return "shards"
    return "local" if looks_local(dataset) else "hub"


def _in_memory_split(dataset: str, text_column: str) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) token arrays of the embedded corpus or a small local corpus."""
    path = str(SHAKESPEARE_FILE) if dataset == SHAKESPEARE else dataset
    tokens = local_tokens(path, text_column)
    cut = int(len(tokens) * TRAIN_FRACTION)
    return tokens[:cut], tokens[cut:]


def parse_hub_id(dataset: str, dataset_config: str | None) -> tuple[str, str | None]:
    """Split `id:config` into (id, config); an explicit `dataset_config` wins."""
    name, _, config = dataset.partition(":")
    return name, dataset_config or config or None


def build_train_loader(
    dataset: str,
    *,
    block_size: int,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    text_column: str = "text",
    dataset_config: str | None = None,
    seed: int = 0,
    prompt_field: str = "prompt",
    completion_field: str = "completion",
) -> TrainLoader:
    """The training loader of this rank (see the module docstring for `dataset`)."""
    common = dict(block_size=block_size, micro_batch_size=micro_batch_size, rank=rank, world_size=world_size)
    kind = source_kind(dataset)
    if kind == "local" and is_pairs_dataset(dataset, text_column=text_column, prompt_field=prompt_field,
                                            completion_field=completion_field):
        examples = read_pairs(dataset, prompt_field=prompt_field, completion_field=completion_field)
        examples.check_fits(block_size, dataset)  # train and validation examples alike, before any step
        return PairsLoader(split_pairs(examples)[0], source=dataset, seed=seed, **common)
    if kind in ("shakespeare", "local"):
        train, _ = _in_memory_split(dataset, text_column)
        return StridedLoader(TokenStream([train]), source=dataset, seed=seed, **common)
    if kind == "shards":
        from data.shards import open_shards

        shards = open_shards(dataset)
        return StridedLoader(TokenStream(shards.train), source=shards.fingerprint, seed=seed, **common)
    # Hub streams are read in order: a shuffle buffer would make resumption inexact, so no seed.
    from data.streaming import StreamingLoader, open_hub_stream

    name, config = parse_hub_id(dataset, dataset_config)
    return StreamingLoader(open_hub_stream(name, config, split="train"), text_column=text_column, source=dataset,
                           **common)


def load_val_tokens(
    dataset: str,
    *,
    max_tokens: int,
    text_column: str = "text",
    dataset_config: str | None = None,
    prompt_field: str = "prompt",
    completion_field: str = "completion",
) -> np.ndarray | PairExamples:
    """The first `max_tokens` held-out tokens (uint16), identical for every rank and world size; for
    prompt/completion data, the first held-out examples holding at most `max_tokens` tokens (at least one)."""
    kind = source_kind(dataset)
    if kind == "local" and is_pairs_dataset(dataset, text_column=text_column, prompt_field=prompt_field,
                                            completion_field=completion_field):
        examples = read_pairs(dataset, prompt_field=prompt_field, completion_field=completion_field)
        return cap_tokens(split_pairs(examples)[1], max_tokens)
    if kind in ("shakespeare", "local"):
        _, val = _in_memory_split(dataset, text_column)
        return np.array(val[:max_tokens], dtype=TOKEN_DTYPE)
    if kind == "shards":
        from data.shards import open_shards

        return np.array(open_shards(dataset).val[:max_tokens], dtype=TOKEN_DTYPE)
    from data.streaming import hub_val_tokens

    name, config = parse_hub_id(dataset, dataset_config)
    return hub_val_tokens(name, config, max_tokens=max_tokens, text_column=text_column)


def small_val_advice(dataset: str, n_val: int, block_size: int) -> str:
    """How `dataset`'s validation split is made and what enlarges it to one window (block_size + 1 tokens),
    for an error about a split of `n_val` tokens. The advice only names changes that work for that source
    (`--val_tokens` only caps a split, so it never helps here)."""
    smaller = f"pass --block_size {n_val - 1} or less, or " if n_val >= 2 else ""
    kind = source_kind(dataset)
    if kind in ("shakespeare", "local"):
        need = round((block_size + 1) / (1 - TRAIN_FRACTION))
        return (f"the validation split of {dataset} is the last {1 - TRAIN_FRACTION:.0%} of its tokens; "
                f"{smaller}add text to the corpus (about {need:,} tokens in all)")
    if kind == "shards":
        return (f"the validation split of {dataset} is its val_000000.bin shard; {smaller}prepare the data again into "
                "a new --out with a larger `python -m data.prepare --val_tokens`")
    from data.streaming import VAL_DOCS

    return (f"the validation split of {dataset} is its first {VAL_DOCS:,} documents; {smaller}pre-tokenize it with "
            "`python -m data.prepare --val_tokens N` and train on that folder")
