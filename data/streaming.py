"""Hub datasets streamed with `datasets` (nothing downloaded in full), packed per rank.

Validation: the first `VAL_DOCS` documents of the stream (FineWeb and OpenWebText ship no
validation split); training skips any document whose text hash is among them, so no split rule
of `datasets` can leak them into training.

Ranks: `split_dataset_by_node` WITHOUT `accelerator.prepare` (each rank its own files when the
number of files divides by the world size, else every world_size-th document), repeated endlessly
so no rank runs dry. Each rank packs its documents (each + <|endoftext|>) into rows of T+1 tokens,
neighbours sharing one token. Resumption is exact: the state is datasets' own `state_dict()` taken
at the start of the current document batch, the few tokens carried over from the batch before, and
the position in the buffer. The order of documents depends on the world size, so a state refuses to
load under another world size (pre-tokenize with `python -m data.prepare` for that).

Ahead of the step: a background thread (`data.ahead.Ahead`) reads and encodes the next `PREFETCH_BATCHES`
document batches while the step runs, each with the datasets state at its start; the loader's state is that of
the batch the step is consuming, never of one read ahead, so a resume neither skips nor repeats the documents
that were read ahead but not used. Encoding uses this rank's share of the node's cores (LOCAL_WORLD_SIZE).

Network faults: huggingface_hub retries a ranged read 5 times (1-8 s apart) and datasets retries a dropped
connection or a 504 again, but a 500/502/503 that outlasts the first 23 s ends the iteration
(docs/hub_reads.md). A document batch that fails so is read again from the state at its start, up to
`READ_RETRIES` times, `RETRY_WAIT` x 2^k s apart (about 5 minutes in all, in the background thread while the
step goes on with the batches read before); then `DataUnavailable`, raised where the step takes the batch that
could not be read, which the trainer turns into a checkpoint of the last completed step (`training.draw`).
"""
from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Iterator

import numpy as np
import torch

from common.errors import UserError
from common.network import network_failure, reaching_the_hub
from data.ahead import Ahead, Inline
from data.hub import PREPARE_ELSEWHERE
from data.settings import DataMismatch
from data.tokens import TOKEN_DTYPE, default_threads, encode_documents

VAL_DOCS = 1000
DOCS_PER_BATCH = 256
PREFETCH_BATCHES = 2  # document batches read and encoded ahead of the step (0: when the step needs them)
STATE_VERSION = 1
MAX_EMPTY_RUN = 10_000  # consecutive empty documents tolerated before a rank counts as having no data
READ_RETRIES = 5  # reads again of a document batch whose stream failed
RETRY_WAIT = 10.0  # seconds before the first of them, doubling: 10 + 20 + 40 + 80 + 160 s


class DataUnavailable(UserError):
    """The stream kept failing through every retry (the Hub unreachable, or answering 5xx)."""


def transient(err: BaseException) -> bool:
    """A failure that reading again may cure: a 5xx or 429 answer, a network error. Not a 4xx or a missing file."""
    status = getattr(getattr(err, "response", None), "status_code", None)
    if status is not None:
        return status >= 500 or status == 429
    if isinstance(err, (FileNotFoundError, PermissionError)):
        return False
    return isinstance(err, OSError) or network_failure(err) is not None


def read_with_retries(read, restart, what: str):
    """`read()`, and after a transient failure `restart()` then `read()` again, `READ_RETRIES` times with growing
    waits; DataUnavailable (one line) when the last try fails too. Other errors go through."""
    for attempt in range(READ_RETRIES + 1):
        try:
            return read()
        except Exception as err:  # noqa: BLE001 (sorted by `transient`)
            if not transient(err):
                raise
            if attempt == READ_RETRIES:
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise DataUnavailable(f"reading {what} failed {READ_RETRIES + 1} times over "
                                      f"{RETRY_WAIT * (2 ** READ_RETRIES - 1):.0f} s ({type(err).__name__}: {first})"
                                      ) from None
            time.sleep(RETRY_WAIT * 2 ** attempt)
            restart()


def open_hub_stream(name: str, config: str | None, split: str = "train", data_files: Any = None,
                    revision: str | None = None):
    """`load_dataset(..., streaming=True)`; UserError (offline, unknown id or config) with the fix. For a Hub id,
    `data.hub.locate_hub_dataset` has checked id, revision and config first and names what to pass here."""
    import datasets

    try:
        with reaching_the_hub(f"stream Hub dataset {name}", PREPARE_ELSEWHERE):
            return datasets.load_dataset(name, name=config, split=split, data_files=data_files, revision=revision,
                                         streaming=True)
    except UserError:
        raise
    except Exception as err:  # datasets raises many types (DatasetNotFoundError, ValueError, ...)
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"cannot stream Hub dataset {name!r} (config {config!r}, split {split!r}): {first_line}; check the "
            "id/config "
            "and network (unset HF_DATASETS_OFFLINE/HF_HUB_OFFLINE), or run `python -m data.prepare` where the Hub "
            "is reachable and train on the shard folder; if you meant a local path, it does not exist"
        ) from None


def _check_column(ds, text_column: str) -> None:
    names = ds.column_names
    if names is not None and text_column not in names:
        raise UserError(f"the dataset has no column {text_column!r} (columns: {', '.join(names)}); pass --text_column")


def text_batches(ds, text_column: str, batch_docs: int = DOCS_PER_BATCH) -> Iterator[list[str]]:
    """Batches of non-empty texts of a (streaming) dataset, in its order."""
    _check_column(ds, text_column)
    batch: list[str] = []
    for row in ds.select_columns([text_column]):
        if row[text_column]:
            batch.append(row[text_column])
        if len(batch) == batch_docs:
            yield batch
            batch = []
    if batch:
        yield batch


def _doc_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12).digest()


def val_documents(ds, text_column: str, n_docs: int = VAL_DOCS) -> list[str]:
    """The held-out documents: the first `n_docs` non-empty texts of the unsplit stream."""
    docs: list[str] = []
    for batch in text_batches(ds, text_column, batch_docs=min(n_docs, DOCS_PER_BATCH)):
        docs.extend(batch[: n_docs - len(docs)])
        if len(docs) >= n_docs:
            break
    return docs


def hub_val_tokens(ds, *, max_tokens: int, text_column: str = "text") -> np.ndarray:
    """The first `max_tokens` tokens of the held-out documents of a (streaming) dataset's train split `ds`."""
    docs = val_documents(ds, text_column, VAL_DOCS)
    return encode_documents(docs)[:max_tokens].copy()


def _threads_per_rank() -> int:
    """Share the node's cores among the ranks running on it."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, default_threads() // max(1, local_ranks))


class StreamingLoader:
    """Endless per-rank (x, y) batches from a streaming dataset; see the module docstring."""

    masked_targets = False  # packed text: every position of every row is a target

    def __init__(
        self,
        ds,
        *,
        block_size: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        text_column: str = "text",
        source: str = "",
        commit: str | None = None,
        val_docs: int = VAL_DOCS,
        docs_per_batch: int = DOCS_PER_BATCH,
        prefetch: int = PREFETCH_BATCHES,
    ) -> None:
        from datasets.distributed import split_dataset_by_node

        _check_column(ds, text_column)
        self.block_size, self.micro_batch_size = block_size, micro_batch_size
        self.rank, self.world_size, self.source, self.commit = rank, world_size, source, commit
        self.text_column, self.docs_per_batch, self.prefetch = text_column, docs_per_batch, prefetch
        what = f"the validation documents of {source or 'the dataset'}"
        self.val_hashes = {_doc_hash(d) for d in read_with_retries(
            lambda: val_documents(ds, text_column, val_docs), lambda: None, what)}  # each try reads from the start
        self.ds = split_dataset_by_node(ds.select_columns([text_column]), rank=rank, world_size=world_size).repeat(None)
        # The reading side (only the thread of `self._ahead` touches these once it runs):
        self._iter: Iterator[dict] | None = None
        self._read_anchor: dict | None = None  # datasets state at the start of the next batch to read (None: start)
        self._ahead: Ahead | Inline | None = None  # started by the first batch the step needs
        # The consuming side (the step's position, what `state_dict` saves):
        self._started = False  # a document batch has been taken
        self._anchor: dict | None = None  # datasets state at the start of the buffer's document batch
        self._carry: list[int] = []  # tokens before that batch that are still in the buffer
        self._buffer = np.zeros(0, dtype=TOKEN_DTYPE)
        self._pos = 0  # next row starts at buffer[pos]

    def _read_batch(self) -> tuple[dict | None, np.ndarray]:
        """The next document batch, encoded, with the datasets state at its start (run by `self._ahead`)."""
        anchor = self._read_anchor
        tokens = encode_documents(self._next_documents(anchor), _threads_per_rank())
        self._read_anchor = self.ds.state_dict()
        return anchor, tokens

    def _close_stream(self) -> None:
        """Close the half-read stream (one left open can hang the interpreter at exit: docs/hub_reads.md)."""
        close = getattr(self._iter, "close", None)
        if close is not None:
            close()
        self._iter = None

    def _taken(self) -> tuple[dict | None, np.ndarray]:
        """The next document batch for the step, read ahead when `prefetch` > 0."""
        if self._ahead is None:
            self._ahead = (Ahead(self._read_batch, self.prefetch, finish=self._close_stream, name="stream-ahead")
                           if self.prefetch else Inline(self._read_batch, finish=self._close_stream))
        self._started = True
        return self._ahead.next()

    def close(self) -> None:
        """Stop reading ahead and close the stream (at the end of a run; reading again reopens it)."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def _next_documents(self, anchor: dict | None) -> list[str]:
        """The next batch of training documents, read again from `anchor` (the datasets state at the batch's start;
        None: the stream's start) after a network failure."""

        def restart() -> None:
            self._close_stream()
            if anchor is not None:
                self.ds.load_state_dict(anchor)
            self._iter = iter(self.ds)

        return read_with_retries(self._read_documents, restart, self.source or "the dataset")

    def _read_documents(self) -> list[str]:
        if self._iter is None:
            self._iter = iter(self.ds)
        docs: list[str] = []
        # The stream repeats forever, so a rank whose share holds only validation or empty documents would
        # spin here (and hang the other ranks): give up after more rejects in a row than can be legitimate.
        max_rejects, rejects = len(self.val_hashes) + MAX_EMPTY_RUN, 0
        for row in self._iter:
            text = row[self.text_column]
            if text and _doc_hash(text) not in self.val_hashes:
                docs.append(text)
                rejects = 0
                if len(docs) == self.docs_per_batch:
                    break
            else:
                rejects += 1
                if rejects > max_rejects:
                    break
        if not docs:
            raise UserError(
                f"rank {self.rank} got no training documents from {self.source or 'the dataset'} (fewer documents than "
                f"ranks, or only validation documents); use a larger dataset or fewer processes"
            )
        return docs

    def _refill(self) -> None:
        """Keep the unread tail, then append the next document batch (re-anchoring the state)."""
        tail = self._buffer[self._pos :]
        self._anchor, tokens = self._taken()
        self._carry = tail.tolist()
        self._buffer = np.concatenate([tail, tokens])
        self._pos = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (x, y): int64 CPU tensors of shape (B, T), y = x shifted by one."""
        T = self.block_size
        rows = np.empty((self.micro_batch_size, T + 1), dtype=np.int64)
        for i in range(self.micro_batch_size):
            while len(self._buffer) - self._pos < T + 1:
                self._refill()
            rows[i] = self._buffer[self._pos : self._pos + T + 1]
            self._pos += T
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position of this rank (each rank saves its own)."""
        return {
            "version": STATE_VERSION,
            "kind": "streaming",
            "source": self.source,
            "commit": self.commit,
            "rank": self.rank,
            "world_size": self.world_size,
            "block_size": self.block_size,
            "datasets_state": self._anchor,
            "started": self._started,
            "carry": list(self._carry),
            "pos": self._pos,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` stopped; same world size and rank required."""
        if state.get("kind") != "streaming":
            raise DataMismatch(f"data of kind {state.get('kind')!r} then, a Hub stream now")
        if state["world_size"] != self.world_size:
            raise UserError(
                f"the streaming data position was saved with world size {state['world_size']}, now {self.world_size}; "
                "resume with the same number of processes or pre-tokenize with python -m data.prepare"
            )
        saved = state.get("commit")
        if saved and self.commit and saved != self.commit:  # the revision moved since: other documents
            raise UserError(f"the streaming data position was saved reading commit {saved} of the dataset, which "
                            f"now reads commit {self.commit}; resume with --dataset pinned to it (id[:config]@{saved})")
        if state["rank"] != self.rank or state["block_size"] != self.block_size:
            raise UserError(
                f"the streaming data position is for rank {state['rank']}, block_size {state['block_size']}; "
                "this is rank "
                f"{self.rank}, block_size {self.block_size}: load data_state_rank{{r}}.json on rank r, "
                "same --block_size"
            )
        self.close()  # what was read ahead belongs to the old position
        self._read_anchor, self._started, self._pos, self._carry, self._anchor = None, False, 0, [], None
        self._buffer = np.zeros(0, dtype=TOKEN_DTYPE)
        if not state["started"]:
            return
        if state["datasets_state"] is not None:
            self.ds.load_state_dict(state["datasets_state"])
        self._read_anchor = state["datasets_state"]
        self._anchor, tokens = self._taken()  # the batch the saved step was consuming, read again
        self._carry = list(state["carry"])
        self._buffer = np.concatenate([np.array(self._carry, dtype=TOKEN_DTYPE), tokens])
        self._pos = int(state["pos"])
