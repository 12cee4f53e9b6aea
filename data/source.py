"""`--dataset` parsed once into a typed source: what a run trains on, what it validates on, how each is read.

`open_source(settings)` decides the kind, once (for local .jsonl data it reads the first record here, and only
here, to tell prompt/completion data from text):

`--dataset`, in the order it is tried                      source             validation (the rest trains)
  shakespeare                                               Shakespeare        the last 10% of its tokens
  a folder holding manifest.json                            TokenShards        its val_000000.bin shard
  local .jsonl whose first record is prompt/completion      PromptCompletion   the last 10% of its examples (>= 1)
  any other local .txt/.jsonl/.parquet file, glob, folder   TextFiles          the last 10% of its tokens
  anything else: a Hub id, id[:config][@revision]          HubStream          its first 1,000 documents

A source builds this rank's train loader, gives the validation set (the same on every rank and world size),
says whether targets are masked, and describes itself (the run header, the model card). Each rank builds its
own loader from (rank, world_size); loaders are never passed to `accelerator.prepare` (which would re-split or
dispatch the data through rank 0).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator, Protocol
from urllib.parse import quote

import numpy as np
import torch

from common.errors import UserError
from common.hub_ids import is_repo_id, split_revision
from data.hub import HubData, locate_hub_dataset
from data.local import VAL_FRACTION, iter_document_batches, local_tokens, looks_local, resolve_files
from data.pairs import PairExamples, PairsLoader, cap_tokens, is_pairs_dataset, read_pairs, split_pairs
from data.settings import SHAKESPEARE, DataConfig, require_a_window
from data.shards import MANIFEST, open_shards
from data.streaming import VAL_DOCS, StreamingLoader, hub_val_tokens, open_hub_stream, text_batches
from data.strided import StridedLoader
from data.tokenizer import EOT_ID, require_known_ids
from data.tokens import TOKEN_DTYPE, TokenStream

SHAKESPEARE_FILE = Path(__file__).with_name("tinyshakespeare.txt")
# Where the presets, the docs and .gitignore put the folders `python -m data.prepare` makes: a `--dataset shards/...`
# is one of them, never a Hub id (a Hub repo of a user named `shards` is read pinned: `shards/name@main`).
SHARDS_HOME = "shards"


class TrainLoader(Protocol):
    """What the trainer uses: endless per-rank batches and a resumable position. `masked_targets`: whether
    targets may be IGNORE (then the batches of a step differ in their number of targets, and the trainer
    normalises the loss by the global count; otherwise every position is a target)."""

    masked_targets: bool

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Let go of what reads ahead (a thread, an open stream); called once at the end of a run."""


def parse_hub_id(dataset: str, dataset_config: str | None) -> tuple[str, str | None, str | None]:
    """`id[:config][@revision]` split into (id, config, revision), an explicit `dataset_config` winning. UserError
    when the id is not one the Hub could hold (huggingface_hub's own rule): what a mistyped local path usually is."""
    head, revision = split_revision(dataset, "--dataset")
    name, _, config = head.partition(":")
    if not is_repo_id(name):
        raise UserError(f"--dataset {dataset!r} is neither an existing local path nor a Hub dataset id; pass "
                        "'shakespeare', a .txt/.jsonl/.parquet file, glob or folder, a folder made by `python -m "
                        "data.prepare`, or a Hub id such as HuggingFaceFW/fineweb-edu:sample-10BT") from None
    return name, dataset_config or config or None, revision


@dataclass(frozen=True)
class DataSource(ABC):
    """One parsed `--dataset`: `dataset` is the value as given (it names the data in messages and in the loader's
    saved state), `val_tokens` caps the validation set."""

    dataset: str
    val_tokens: int

    masked_targets: ClassVar[bool] = False  # whether targets may be IGNORE (prompt/completion data)
    sized_ahead: ClassVar[bool] = True  # whether its loader knows its size before reading it all (not a stream)
    held_out: ClassVar[str]  # which part validates, as the run header and the small-split advice say it

    @abstractmethod
    def train_loader(self, *, block_size: int, micro_batch_size: int, rank: int, world_size: int,
                     seed: int) -> TrainLoader:
        """This rank's endless, resumable training batches."""

    @abstractmethod
    def val_set(self, block_size: int) -> np.ndarray | PairExamples:
        """The validation set, identical on every rank and world size: the first `val_tokens` held-out tokens
        (uint16), or the first held-out examples holding at most `val_tokens` tokens (at least one). UserError
        when it cannot be scored with `block_size`, naming what would fix it for this source."""

    @abstractmethod
    def what(self) -> str:
        """What the data is, in a few words."""

    @property
    def hub_id(self) -> str | None:
        """The Hub dataset repo that holds the data (the model card's metadata), or None."""
        return None

    @property
    def pinned(self) -> str:
        """`--dataset` naming exactly this data again (a Hub dataset at its commit), as config.yaml records it."""
        return self.dataset

    @property
    def max_token_id(self) -> int:
        """The largest token id the data may hold: text is tokenized here with GPT-2's tokenizer, whose largest id,
        `<|endoftext|>`, ends every document (every example); shards say what they hold."""
        return EOT_ID

    def check_vocab(self, vocab_size: int, model: str) -> None:
        """Refuse (one line) a model, named `model`, whose `vocab_size` ids do not cover this data's."""
        require_known_ids(self.max_token_id, vocab_size, f"--dataset {self.dataset}", model)

    def describe(self) -> str:
        """The data's line in the run header."""
        return f"data: {self.dataset} ({self.what()}) | validation: {self.held_out}, at most {self.val_tokens:,} tokens"

    def card_text(self) -> str:
        """How the model card names the training data (Markdown): a link to its Hub page, else `--dataset`."""
        if self.hub_id:
            return f"[{self.hub_id}](https://huggingface.co/datasets/{self.hub_id})"
        return f"`{self.dataset}`"


class TokenSource(DataSource):
    """Packed text: every position of every row is a target; validation is a token array."""

    @abstractmethod
    def held_out_tokens(self, max_tokens: int) -> np.ndarray:
        """The first `max_tokens` tokens of the validation split."""

    @abstractmethod
    def enlarge(self, block_size: int) -> str:
        """What makes this source's validation split longer."""

    def val_set(self, block_size: int) -> np.ndarray:
        tokens = np.array(self.held_out_tokens(self.val_tokens), dtype=TOKEN_DTYPE)
        require_a_window(len(tokens), block_size, self.val_advice(len(tokens), block_size))
        return tokens

    def val_advice(self, n_val: int, block_size: int) -> str:
        """How the validation split is made and what enlarges it to one window, for a split of `n_val` tokens.
        Only changes that work for this source (`--val_tokens` caps a split, so it never helps here)."""
        smaller = f"pass --block_size {n_val - 1} or less, or " if n_val >= 2 else ""
        return f"the validation split of {self.dataset} is {self.held_out}; {smaller}{self.enlarge(block_size)}"


@dataclass(frozen=True)
class TextFiles(TokenSource):
    """Local .txt/.jsonl/.parquet files (`data.local`), tokenized in memory; the last 10% of tokens validate."""

    text_column: str

    held_out: ClassVar[str] = f"the last {VAL_FRACTION:.0%} of its tokens"

    @property
    def path(self) -> str:
        """The file, glob or folder to read."""
        return self.dataset

    def what(self) -> str:
        return f"local text files, tokenized in memory; column {self.text_column!r} of .jsonl/.parquet"

    def split(self) -> tuple[np.ndarray, np.ndarray]:
        """(train, validation) tokens (tokenized once per process: `local_tokens` caches)."""
        tokens = local_tokens(self.path, self.text_column)
        cut = int(len(tokens) * (1 - VAL_FRACTION))
        return tokens[:cut], tokens[cut:]

    def train_loader(self, *, block_size: int, micro_batch_size: int, rank: int, world_size: int,
                     seed: int) -> StridedLoader:
        return StridedLoader(TokenStream([self.split()[0]]), block_size=block_size, micro_batch_size=micro_batch_size,
                             rank=rank, world_size=world_size, seed=seed, source=self.dataset)

    def held_out_tokens(self, max_tokens: int) -> np.ndarray:
        return self.split()[1][:max_tokens]

    def enlarge(self, block_size: int) -> str:
        return f"add text to the corpus (about {round((block_size + 1) / VAL_FRACTION):,} tokens in all)"

    def document_batches(self, split: str, batch_docs: int) -> Iterator[list[str]]:
        """Batches of non-empty documents, in order (`python -m data.prepare`; local files have one split). Lazy:
        nothing is read before the first batch is asked for."""
        yield from iter_document_batches(resolve_files(self.path), self.text_column, batch_docs)


@dataclass(frozen=True)
class Shakespeare(TextFiles):
    """Tiny Shakespeare, shipped in data/: no network needed."""

    @property
    def path(self) -> str:
        return str(SHAKESPEARE_FILE)

    @property
    def hub_id(self) -> str:
        return "karpathy/tiny_shakespeare"

    def what(self) -> str:
        return "Tiny Shakespeare, shipped in data/"


@dataclass(frozen=True)
class TokenShards(TokenSource):
    """A folder of uint16 token shards written by `python -m data.prepare` (`data.shards`)."""

    held_out: ClassVar[str] = "its val_000000.bin shard"

    def what(self) -> str:
        return "token shards made by data.prepare"

    def train_loader(self, *, block_size: int, micro_batch_size: int, rank: int, world_size: int,
                     seed: int) -> StridedLoader:
        shards = open_shards(self.dataset)
        return StridedLoader(TokenStream(shards.train), block_size=block_size, micro_batch_size=micro_batch_size,
                             rank=rank, world_size=world_size, seed=seed, source=shards.fingerprint)

    def held_out_tokens(self, max_tokens: int) -> np.ndarray:
        return open_shards(self.dataset).val[:max_tokens]

    @property
    def max_token_id(self) -> int:
        return open_shards(self.dataset).max_id

    def enlarge(self, block_size: int) -> str:
        return "prepare the data again into a new --out with a larger `python -m data.prepare --val_tokens`"


@dataclass(frozen=True)
class HubStream(TokenSource):
    """A Hub dataset streamed with `datasets` (`data.streaming`): nothing downloaded in full. Read in order: a
    shuffle buffer would make resumption inexact, so the seed does not apply. Every read is made at the commit
    `revision` (main when None) pointed at when first located (`data.hub`), through the parquet conversion of a
    repo that holds only a loading script."""

    name: str
    config: str | None
    text_column: str
    revision: str | None = None

    held_out: ClassVar[str] = f"its first {VAL_DOCS:,} documents"
    sized_ahead: ClassVar[bool] = False

    @property
    def hub_id(self) -> str:
        return self.name

    def card_text(self) -> str:
        """A link to the dataset's page at the revision read, and the config and revision (no Hub call)."""
        tree = f"/tree/{quote(self.revision, safe='')}" if self.revision else ""
        extra = ", ".join(f"{k} `{v}`" for k, v in (("config", self.config), ("revision", self.revision)) if v)
        return f"[{self.name}](https://huggingface.co/datasets/{self.name}{tree})" + (f" ({extra})" if extra else "")

    def location(self) -> HubData:
        """Where the documents are (asks the Hub once per process)."""
        return locate_hub_dataset(self.name, self.config, self.revision)

    @property
    def pinned(self) -> str:
        return self.location().spec()

    def what(self) -> str:
        where = self.location()
        config = f", config {where.config}" if where.config else ""
        at = f"revision {self.revision}, " if self.revision and self.revision != where.commit else ""
        note = f"; {where.note()}" if where.converted else ""
        return f"Hub dataset {where.repo_id}{config} ({at}commit {where.commit[:12]}), column " \
               f"{self.text_column!r}, streamed{note}"

    def stream(self, split: str):
        """The `datasets` stream of `split`, at the located commit."""
        where = self.location()
        where.check_split(split)
        return open_hub_stream(where.repo_id, None if where.converted else where.config, split,
                               data_files=where.data_files, revision=where.commit)

    def train_loader(self, *, block_size: int, micro_batch_size: int, rank: int, world_size: int,
                     seed: int) -> StreamingLoader:
        return StreamingLoader(self.stream("train"), block_size=block_size, micro_batch_size=micro_batch_size,
                               rank=rank, world_size=world_size, text_column=self.text_column, source=self.dataset,
                               commit=self.location().commit)

    def held_out_tokens(self, max_tokens: int) -> np.ndarray:
        return hub_val_tokens(self.stream("train"), max_tokens=max_tokens, text_column=self.text_column)

    def enlarge(self, block_size: int) -> str:
        return "pre-tokenize it with `python -m data.prepare --val_tokens N` and train on that folder"

    def document_batches(self, split: str, batch_docs: int) -> Iterator[list[str]]:
        """Batches of non-empty documents of `split`, in the stream's order (`python -m data.prepare`). Lazy: the
        stream is opened when the first batch is asked for."""
        yield from text_batches(self.stream(split), self.text_column, batch_docs)


@dataclass(frozen=True)
class PromptCompletion(DataSource):
    """Local .jsonl prompt/completion records (`data.pairs`): one padded row per example, a masked loss; the last
    10% of the examples (at least one) validate."""

    prompt_field: str
    completion_field: str

    masked_targets: ClassVar[bool] = PairsLoader.masked_targets
    held_out: ClassVar[str] = f"the last {VAL_FRACTION:.0%} of its examples"

    def what(self) -> str:
        return (f"prompt/completion examples, fields {self.prompt_field!r} and {self.completion_field!r}; the loss "
                "counts completion tokens only")

    def examples(self) -> PairExamples:
        """Every example, in file and line order (read once per process: `read_pairs` caches)."""
        return read_pairs(self.dataset, prompt_field=self.prompt_field, completion_field=self.completion_field)

    def train_loader(self, *, block_size: int, micro_batch_size: int, rank: int, world_size: int,
                     seed: int) -> PairsLoader:
        examples = self.examples()
        examples.check_fits(block_size, self.dataset)  # train and validation examples alike, before any step
        return PairsLoader(split_pairs(examples)[0], block_size=block_size, micro_batch_size=micro_batch_size,
                           rank=rank, world_size=world_size, seed=seed, source=self.dataset)

    def val_set(self, block_size: int) -> PairExamples:
        examples = cap_tokens(split_pairs(self.examples())[1], self.val_tokens)
        examples.check_fits(block_size, self.dataset)
        return examples


def _pinned_hub_id(dataset: str) -> bool:
    """`id[:config]@revision` that names no local path: a revision may hold `/` (`refs/convert/parquet`), which
    would otherwise make it look like a path. (No glob character can be in a git ref.)"""
    head, at, _ = dataset.partition("@")
    return bool(at) and is_repo_id(head.partition(":")[0]) and not Path(dataset).expanduser().exists() \
        and not any(c in dataset for c in "*?[")


def _refuse_a_shard_folder_not_made_yet(dataset: str) -> None:
    """`shards/name` (the FineWeb-Edu presets' dataset) before data.prepare made it, which would otherwise read as a
    Hub id: the command that makes it."""
    if Path(dataset).parts[:1] == (SHARDS_HOME,) and "@" not in dataset and not looks_local(dataset):
        raise UserError(f"--dataset {dataset}: no such folder yet; token shards are made once, with `python -m "
                        f"data.prepare --dataset <a Hub id or local files> --out {dataset}` (the FineWeb-Edu presets: "
                        "--dataset HuggingFaceFW/fineweb-edu:sample-10BT), or pass a Hub id as --dataset to stream "
                        "the data instead")


def open_source(settings: DataConfig) -> DataSource:
    """Parse `settings.dataset` into its source (module docstring). `settings` is a `DataConfig` or any object
    with its six attributes (`configs.DataConfig`, a run's config). Reads nothing but, for local .jsonl data,
    the first record; a local path that names no data files (missing, an empty glob, a shard folder not made yet)
    is refused here, so that a run says so before it loads any weights."""
    s, dataset = settings, settings.dataset
    if dataset == SHAKESPEARE:
        return Shakespeare(dataset, s.val_tokens, text_column=s.text_column)
    if (Path(dataset).expanduser() / MANIFEST).is_file():
        return TokenShards(dataset, s.val_tokens)
    _refuse_a_shard_folder_not_made_yet(dataset)
    if looks_local(dataset) and not _pinned_hub_id(dataset):
        resolve_files(dataset)  # the files are there
        if is_pairs_dataset(dataset, text_column=s.text_column, prompt_field=s.prompt_field,
                            completion_field=s.completion_field):
            return PromptCompletion(dataset, s.val_tokens, prompt_field=s.prompt_field,
                                    completion_field=s.completion_field)
        return TextFiles(dataset, s.val_tokens, text_column=s.text_column)
    name, config, revision = parse_hub_id(dataset, s.dataset_config)
    return HubStream(dataset, s.val_tokens, name=name, config=config, text_column=s.text_column, revision=revision)
