"""Token shards on disk: raw little-endian uint16 files plus a `manifest.json`, read by np.memmap.

A shard is written under a temporary name, fsynced and renamed, and only then listed in the
manifest, which is itself replaced atomically. So a crash never leaves a listed shard half-written,
and training refuses a folder whose prepare has not finished (`"complete": false`) or whose files
do not have the sizes the manifest records.

Each shard's entry holds its file name, token count, sha256, largest token id (`max_id`) and where in the
source it starts (`start`: document index and token offset), so that a re-run of the prepare can rebuild a
damaged shard alone. Older manifests lack the last two: their largest id is read from the shards when opened.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.atomic import rename_into_place, sha256, temp_path
from common.errors import UserError
from data.tokenizer import TOKENIZER_NAME
from data.tokens import TOKEN_DTYPE

MANIFEST = "manifest.json"
FORMAT = "gpt2-accelerate-token-shards"
FORMAT_VERSION = 1


class WriteFailed(Exception):
    """A file of a shard folder could not be written (a full disk, a quota, a folder made read-only): told apart
    from a failed read of the source, which is no reason to free disk space."""

    def __init__(self, path: Path, err: OSError) -> None:
        super().__init__(f"{path}: {err.strerror or err}")
        self.path, self.reason = path, err.strerror or str(err)


class ShardWriter:
    """Writes one shard under a temporary name, hashing as it goes; `finish()` publishes it. `start`: where in the
    source its first token is, recorded in its entry. A write or publish that fails (a full disk) removes the
    temporary file before the error goes on: nothing half-written is left."""

    def __init__(self, folder: Path, name: str, start: dict[str, int] | None = None) -> None:
        self.path = folder / name
        self.tmp = temp_path(self.path)
        self.start = start
        self.file = self.tmp.open("wb")
        self.sha = hashlib.sha256()
        self.tokens = 0
        self.max_id = -1

    def write(self, tokens: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens, dtype="<u2")
        try:
            self.file.write(data.tobytes())
        except OSError as err:
            self.abandon()
            raise WriteFailed(self.path, err) from err
        self.sha.update(data.tobytes())
        self.tokens += len(data)
        self.max_id = max(self.max_id, int(data.max())) if len(data) else self.max_id

    def finish(self) -> dict[str, Any]:
        """Flush and rename to the final name; return the manifest entry."""
        try:
            self.file.close()
            rename_into_place(self.tmp, self.path)
        except OSError as err:
            self.abandon()
            raise WriteFailed(self.path, err) from err
        entry = {"file": self.path.name, "tokens": self.tokens, "sha256": self.sha.hexdigest(), "max_id": self.max_id}
        return entry if self.start is None else {**entry, "start": self.start}

    def abandon(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def shard_damage(folder: Path, entry: dict[str, Any]) -> str | None:
    """What is wrong with a listed shard against its manifest entry (size, then sha256: same-size changes too), as
    a phrase naming the file; None when it is the shard written. Reads the whole file."""
    path = folder / entry["file"]
    expected = int(entry["tokens"]) * np.dtype(TOKEN_DTYPE).itemsize
    if not path.is_file():
        return f"{path} is missing"
    if (size := path.stat().st_size) != expected:
        return f"{path} is {size} bytes, the manifest says {expected}"
    if sha256(path) != entry["sha256"]:
        return f"{path} was changed (its sha256 differs from the manifest's)"
    return None


def read_manifest(folder: Path) -> dict[str, Any]:
    """The parsed manifest; UserError if missing, unreadable or of another format."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{folder} has no {MANIFEST}; create the shards with "
                        f"`python -m data.prepare --out {folder}`") from None
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {path} ({err}); re-create the shards with `python -m data.prepare`") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise UserError(f"{path} is not a version-{FORMAT_VERSION} shard manifest; re-create it with "
                        "`python -m data.prepare`")
    return manifest


def _largest_id(shard: np.ndarray, entry: dict[str, Any]) -> int:
    """The shard's largest token id: recorded by the prepare, else (an older manifest) read from the file."""
    if "max_id" in entry:
        return int(entry["max_id"])
    return int(shard.max()) if len(shard) else -1


@dataclass
class Shards:
    """Memory-mapped shards of a prepared folder."""

    folder: Path
    manifest: dict[str, Any]
    train: list[np.ndarray]
    val: np.ndarray

    @property
    def fingerprint(self) -> str:
        """Identifies the token stream (saved with loader states to catch a swapped dataset)."""
        hashes = "".join(entry["sha256"] for entry in self.manifest["train"])
        return "shards:" + hashlib.sha256(hashes.encode()).hexdigest()[:16]

    @property
    def max_id(self) -> int:
        """The largest token id of every shard, validation included (what a model's vocabulary must cover)."""
        entries = [*self.manifest["train"], self.manifest["val"]]
        return max(_largest_id(shard, entry) for shard, entry in zip([*self.train, self.val], entries))


def _open(folder: Path, entry: dict[str, Any], redo: str) -> np.ndarray:
    path = folder / entry["file"]
    expected = int(entry["tokens"]) * np.dtype(TOKEN_DTYPE).itemsize
    size = path.stat().st_size if path.is_file() else None
    if size != expected:
        found = "missing" if size is None else f"{size} bytes"
        raise UserError(f"shard {path} is {found}, the manifest says {expected} bytes; {redo}")
    if expected == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype="<u2", mode="r")


def open_shards(folder: str | Path) -> Shards:
    """Open a finished prepare, checking every shard's size against the manifest."""
    folder = Path(folder).expanduser()
    manifest = read_manifest(folder)
    source = manifest.get("source", {}).get("dataset", "<dataset>")
    redo = f"re-run `python -m data.prepare --dataset {source} --out {folder}` (or delete the folder and prepare again)"
    if not manifest.get("complete"):
        raise UserError(f"the prepare that writes {folder} has not finished; {redo} to complete it")
    if (tokenizer := manifest.get("tokenizer")) != TOKENIZER_NAME:
        raise UserError(f"{folder} holds tokens of the tokenizer {tokenizer!r}, but runs here read and write "
                        f"{TOKENIZER_NAME!r} (GPT-2's); prepare the data again into a new folder with "
                        f"`python -m data.prepare --dataset {source} --out NEW_FOLDER`")
    if not manifest["train"]:
        raise UserError(f"{folder} holds no training tokens; {redo}")
    train = [_open(folder, entry, redo) for entry in manifest["train"]]
    val = _open(folder, manifest["val"], redo)
    return Shards(folder, manifest, train, val)
