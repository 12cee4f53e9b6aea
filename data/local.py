"""Local corpora: a .txt, .jsonl or .parquet file, a glob, or a folder of them, read as documents.

A .txt file is one document; a .jsonl line and a parquet row are one document each (their
`text_column`). Files are read in sorted path order so every run and every rank sees the same
stream. Small corpora are tokenized in memory (`local_tokens`); larger ones go through
`python -m data.prepare` into token shards.

Text must be UTF-8: a .jsonl line that is not is refused (file, line and byte offset), a .parquet file
that pyarrow cannot read is refused; a .txt file's invalid bytes become U+FFFD, with a warning when they
are 1% or more of it (a binary file passed by mistake), and the run goes on.
"""
from __future__ import annotations

import functools
import glob
import json
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from common.errors import UserError, json_problem
from data.tokens import encode_documents

EXTENSIONS = (".txt", ".jsonl", ".parquet")
# Above this many bytes of input, in-memory tokenization would hold several GB: use data.prepare.
MAX_IN_MEMORY_BYTES = 1 << 30
DOCS_PER_BATCH = 1024
# Data read in memory (local text, prompt/completion examples): its last 10% is held out for validation.
VAL_FRACTION = 0.1
# A .txt file with at least this share of U+FFFD (bytes that are not UTF-8) or NUL characters gets a warning.
MAX_BINARY_SHARE = 0.01


def looks_local(dataset: str) -> bool:
    """True when `dataset` names a path (exists, is a glob, or has a known extension/separator)."""
    return (
        Path(dataset).exists()
        or any(c in dataset for c in "*?[")
        or dataset.lower().endswith(EXTENSIONS)
        or dataset.startswith((".", "/", "~"))
        or dataset.count("/") > 1
    )


def resolve_files(dataset: str) -> list[Path]:
    """The sorted data files named by a file, glob or folder; UserError if there are none."""
    path = Path(dataset).expanduser()
    if any(c in dataset for c in "*?["):
        files = [Path(p) for p in sorted(glob.glob(str(path), recursive=True))]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    elif path.is_file():
        files = [path]
    else:
        raise UserError(f"dataset path {dataset!r} does not exist; pass an existing .txt/.jsonl/.parquet file, glob "
                        "or folder")
    if path.is_file() and not dataset.lower().endswith(EXTENSIONS):
        raise UserError(f"{dataset!r} is not a .txt, .jsonl or .parquet file; convert it to one of those formats")
    files = [f for f in files if f.suffix.lower() in EXTENSIONS]
    if not files:
        raise UserError(f"no .txt, .jsonl or .parquet files found for {dataset!r}; check the path or glob")
    return files


def iter_jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON value) of every non-blank line; UserError (file:line) on bad UTF-8 or JSON."""
    with path.open("rb") as f:  # bytes, so that a non-UTF-8 line is named by its number and offset
        offset = 0
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UserError(f"{path}:{line_no} is not UTF-8 (byte {offset + err.start} of the file); re-save the "
                                "file as UTF-8 or remove that line") from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{line_no} is not valid JSON ({json_problem(err)}); fix or remove that "
                                "line") from None
            yield line_no, row


def _iter_jsonl(path: Path, text_column: str) -> Iterator[str]:
    for line_no, row in iter_jsonl_records(path):
        if not isinstance(row, dict) or text_column not in row:
            raise UserError(f"{path}:{line_no} has no {text_column!r} field; pass --text_column with the name of the "
                            "text field")
        if row[text_column] is not None:  # as parquet's reader does: a null text is no document
            yield str(row[text_column])


def _iter_parquet(path: Path, text_column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    def damaged(err: Exception) -> UserError:  # pyarrow raises several types for a damaged file
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        return UserError(f"cannot read parquet file {path} ({reason}); check that it is a complete parquet file")

    try:
        pf = pq.ParquetFile(path)
    except Exception as err:
        raise damaged(err) from None
    if text_column not in pf.schema_arrow.names:
        raise UserError(
            f"{path} has no column {text_column!r} (columns: {', '.join(pf.schema_arrow.names)}); pass --text_column"
        )
    batches = pf.iter_batches(batch_size=DOCS_PER_BATCH, columns=[text_column])
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as err:  # a footer that reads but row groups that do not
            raise damaged(err) from None
        yield from (str(t) for t in batch.column(0).to_pylist() if t is not None)


def _read_txt(path: Path) -> str:
    """The file's text; bytes that are not UTF-8 become U+FFFD, with a warning when they are many."""
    text = path.read_text(encoding="utf-8", errors="replace")
    bad = text.count("\ufffd") + text.count("\x00")
    if text and bad / len(text) >= MAX_BINARY_SHARE:
        print(f"warning: {path}: {bad:,} of {len(text):,} characters ({bad / len(text):.0%}) are invalid UTF-8 or "
              "NUL bytes, so it looks binary or not UTF-8; training goes on with them as U+FFFD/NUL tokens; re-save "
              "it as UTF-8 text or remove it from the dataset", file=sys.stderr, flush=True)
    return text


def iter_documents(files: list[Path], text_column: str = "text") -> Iterator[str]:
    """Yield the documents of the files, in order."""
    for path in files:
        suffix = path.suffix.lower()
        if suffix == ".txt":
            yield _read_txt(path)
        elif suffix == ".jsonl":
            yield from _iter_jsonl(path, text_column)
        else:
            yield from _iter_parquet(path, text_column)


def iter_document_batches(files: list[Path], text_column: str = "text",
                          batch_size: int = DOCS_PER_BATCH) -> Iterator[list[str]]:
    """Yield lists of up to `batch_size` non-empty documents (empty ones carry no tokens)."""
    batch: list[str] = []
    for doc in iter_documents(files, text_column):
        if doc:
            batch.append(doc)
        if len(batch) >= batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


@functools.lru_cache(maxsize=4)
def _cached_tokens(key: tuple, text_column: str) -> np.ndarray:
    files = [Path(entry[0]) for entry in key]
    parts = [encode_documents(batch) for batch in iter_document_batches(files, text_column)]
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
    tokens.flags.writeable = False  # shared by the train loader and the val split
    return tokens


def local_tokens(dataset: str, text_column: str = "text") -> np.ndarray:
    """Tokenize a small local corpus in memory (cached per process); UserError if empty or too big."""
    files = resolve_files(dataset)
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    size = sum(entry[1] for entry in key)
    if size > MAX_IN_MEMORY_BYTES:
        raise UserError(
            f"{dataset!r} holds {size / 1e9:.1f} GB of text, too much to tokenize in memory; "
            f"run `python -m data.prepare --dataset {dataset} --out <folder>` and train on that folder"
        )
    tokens = _cached_tokens(key, text_column)
    if len(tokens) == 0:
        raise UserError(f"{dataset!r} contains no text; check the files (or --text_column)")
    return tokens
