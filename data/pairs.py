"""Prompt/completion data: a .jsonl whose records hold a prompt and a completion, trained with a masked loss.

Detection (`is_pairs_dataset`): a local dataset made only of .jsonl files whose first record (the first
non-blank line of the first file in sorted order) has both the prompt and the completion field, or one of
them and no text field (so that a missing field is reported by file and line, not as a missing `text`).
Any other .jsonl stays a text corpus.

One example, one row (invariants the tests pin):
- tokens = encode(prompt) + encode(completion) + [EOT]; prompt and completion are encoded separately (no
  BPE merge across the boundary), so the mask boundary is exact. x = tokens[:-1], y = tokens[1:].
- y is -100 wherever the target is a prompt token: the targets are the completion tokens and the EOT after
  them. (With an empty prompt the first completion token has no context, so it is input only.)
- Rows are right-padded to block_size (x with EOT, y with -100). Attention is causal, so padding after an
  example changes none of its logits. Nothing is packed and nothing is cut: an example longer than
  block_size + 1 tokens is an error that counts them, names the first (file:line) and the longest.
- An empty completion (no completion tokens) is an error naming its file:line.

Split: the last 10% of the examples (at least one) are held out for validation, as the last 10% of the
tokens are for a text corpus.

`PairsLoader` hands out examples as `StridedLoader` hands out sequences: a global cursor over an order fixed
by (seed, epoch); rank r takes rows [cursor + r*B, cursor + (r+1)*B), so ranks see disjoint examples, the
examples of an optimizer step do not depend on the split into processes and micro-batches, and the state
(one integer) resumes exactly, with any world size.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.errors import UserError
from data.local import MAX_IN_MEMORY_BYTES, VAL_FRACTION, iter_jsonl_records, resolve_files
from data.settings import DataMismatch
from data.strided import _mix, permute_index
from data.tokenizer import EOT_ID, IGNORE, get_tokenizer

STATE_VERSION = 1


@dataclass(frozen=True)
class PairExamples:
    """Tokenized examples: `tokens[i]` = prompt + completion + EOT, of which the first `n_prompt[i]` are the
    prompt; `where[i]` is the example's file:line."""

    tokens: tuple[np.ndarray, ...]
    n_prompt: tuple[int, ...]
    where: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, part: slice) -> PairExamples:
        return PairExamples(self.tokens[part], self.n_prompt[part], self.where[part])

    def n_targets(self) -> int:
        """Target tokens over all examples: each completion and its EOT."""
        return sum(len(t) - max(p, 1) for t, p in zip(self.tokens, self.n_prompt))

    def check_fits(self, block_size: int, source: str) -> None:
        """UserError unless every example fits one row of block_size inputs (block_size + 1 tokens)."""
        lengths = np.array([len(t) for t in self.tokens])
        too_long = np.flatnonzero(lengths > block_size + 1)
        if len(too_long):
            longest = int(lengths.max())
            raise UserError(
                f"{len(too_long):,} of {len(self):,} examples in {source} are longer than block_size + 1 = "
                f"{block_size + 1} tokens (the first at {self.where[too_long[0]]}, the longest {longest:,} tokens) "
                f"and are never cut; pass --block_size {longest - 1} or more, or shorten or remove them")

    def rows(self, indices: list[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 (len(indices), block_size): the examples right-padded, y masked (module docstring)."""
        x = torch.full((len(indices), block_size), EOT_ID, dtype=torch.long)
        y = torch.full((len(indices), block_size), IGNORE, dtype=torch.long)
        for r, i in enumerate(indices):
            tokens, n_prompt = torch.from_numpy(self.tokens[i].astype(np.int64)), self.n_prompt[i]
            n = len(tokens) - 1
            x[r, :n] = tokens[:-1]
            y[r, :n] = tokens[1:]
            y[r, :max(n_prompt - 1, 0)] = IGNORE  # targets that are prompt tokens
        return x, y


def _first_record(path: Path) -> Any:
    """The first parsed record of a .jsonl file, or None when it has none or its first line is not JSON."""
    try:
        return next(iter(iter_jsonl_records(path)), (0, None))[1]
    except UserError:  # the text reader reports it
        return None


def is_pairs_dataset(dataset: str, *, text_column: str, prompt_field: str, completion_field: str) -> bool:
    """Whether a local dataset is prompt/completion data (module docstring); False for anything else."""
    try:
        files = resolve_files(dataset)
    except UserError:
        return False
    if any(f.suffix.lower() != ".jsonl" for f in files):
        return False
    record = _first_record(files[0])
    if not isinstance(record, dict):
        return False
    has = (prompt_field in record, completion_field in record)
    return all(has) or (any(has) and text_column not in record)


def _field(row: Any, name: str, where: str, flag: str) -> str:
    value = row.get(name) if isinstance(row, dict) else None
    if not isinstance(value, str):
        what = "no" if value is None else f"a non-string ({type(value).__name__})"
        raise UserError(f"{where} has {what} {name!r} field; every line of prompt/completion data needs string "
                        f"fields {name!r} (or pass {flag} with the field's name)")
    return value


@functools.lru_cache(maxsize=4)
def _read(key: tuple, prompt_field: str, completion_field: str) -> PairExamples:
    enc = get_tokenizer()
    prompts, completions, where = [], [], []
    for path in (Path(entry[0]) for entry in key):
        for line_no, row in iter_jsonl_records(path):
            at = f"{path}:{line_no}"
            prompts.append(_field(row, prompt_field, at, "--prompt_field"))
            completions.append(_field(row, completion_field, at, "--completion_field"))
            where.append(at)
    prompt_ids = enc.encode_ordinary_batch(prompts)
    completion_ids = enc.encode_ordinary_batch(completions)
    tokens, n_prompt = [], []
    for p, c, at in zip(prompt_ids, completion_ids, where):
        if not c:
            raise UserError(f"{at} has an empty completion (no completion tokens, nothing to learn); "
                            "fill it in or remove that line")
        tokens.append(np.array(p + c + [EOT_ID], dtype=np.uint16))
        n_prompt.append(len(p))
    return PairExamples(tuple(tokens), tuple(n_prompt), tuple(where))


def read_pairs(dataset: str, *, prompt_field: str = "prompt", completion_field: str = "completion") -> PairExamples:
    """Every example of the dataset's .jsonl files, in file and line order (cached per process)."""
    files = resolve_files(dataset)
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    size = sum(entry[1] for entry in key)
    if size > MAX_IN_MEMORY_BYTES:
        raise UserError(f"{dataset!r} holds {size / 1e9:.1f} GB of prompt/completion data, more than is read in "
                        f"memory ({MAX_IN_MEMORY_BYTES / 1e9:.1f} GB); split it into a smaller file")
    examples = _read(key, prompt_field, completion_field)
    if len(examples) < 2:
        raise UserError(f"{dataset!r} holds {len(examples)} prompt/completion example(s); at least 2 are needed "
                        "(the last 10%, at least one, are held out for validation)")
    return examples


def split_pairs(examples: PairExamples) -> tuple[PairExamples, PairExamples]:
    """(train, val): the last 10% of the examples, at least one, are validation."""
    n_val = max(1, round(len(examples) * VAL_FRACTION))
    return examples[:-n_val], examples[-n_val:]


def cap_tokens(examples: PairExamples, max_tokens: int) -> PairExamples:
    """The first examples holding at most `max_tokens` tokens in all (at least one example)."""
    lengths = np.cumsum([len(t) for t in examples.tokens])
    return examples[:max(1, int(np.searchsorted(lengths, max_tokens, side="right")))]


class PairsLoader:
    """Per-rank padded, masked batches of prompt/completion examples; see the module docstring."""

    masked_targets = True  # rows hold padding and prompt targets: the trainer normalises by the global count

    def __init__(self, examples: PairExamples, *, block_size: int, micro_batch_size: int, rank: int,
                 world_size: int, seed: int = 0, source: str = "") -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.examples = examples
        self.block_size = block_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.source = source
        self.n_examples = len(examples)
        self.cursor = 0

    def example_index(self, g: int) -> int:
        """Which example the g-th handed-out row (over all epochs) is."""
        epoch, i = divmod(g, self.n_examples)
        return permute_index(i, self.n_examples, _mix(self.seed * 1_000_003 + epoch))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (x, y), int64 (B, block_size); y is -100 on prompt targets and padding."""
        first = self.cursor + self.rank * self.micro_batch_size
        indices = [self.example_index(g) for g in range(first, first + self.micro_batch_size)]
        self.cursor += self.world_size * self.micro_batch_size
        return self.examples.rows(indices, self.block_size)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position; identical on every rank (the rank is kept for checks)."""
        return {"version": STATE_VERSION, "kind": "pairs", "source": self.source, "cursor": self.cursor,
                "n_examples": self.n_examples, "block_size": self.block_size, "seed": self.seed,
                "rank": self.rank, "world_size": self.world_size}

    def close(self) -> None:
        """Nothing to let go: the rows are computed when asked for."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; any world size or micro-batch size may resume it."""
        if state.get("kind") != "pairs":
            raise DataMismatch(f"data of kind {state.get('kind')!r} then, prompt/completion examples now")
        for key in ("block_size", "seed"):
            if state.get(key) != getattr(self, key):
                raise UserError(f"the saved data state has {key}={state.get(key)!r} but this run has "
                                f"{getattr(self, key)!r}; resume with the same --block_size and --seed as the "
                                "original run")
        if state.get("n_examples") != self.n_examples:
            raise DataMismatch(f"{state.get('n_examples')} examples then, {self.n_examples} now")
        self.cursor = int(state["cursor"])
