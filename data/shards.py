"""Token shards on disk: raw little-endian uint16 files plus a `manifest.json`, read by np.memmap.

A shard is written under a temporary name, fsynced and renamed, and only then listed in the
manifest, which is itself replaced atomically. So a crash never leaves a listed shard half-written,
and training refuses a folder whose prepare has not finished (`"complete": false`) or whose files
do not have the sizes the manifest records.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.atomic import rename_into_place, temp_path
from common.errors import UserError
from data.tokens import TOKEN_DTYPE

MANIFEST = "manifest.json"
FORMAT = "gpt2-accelerate-token-shards"
FORMAT_VERSION = 1


class ShardWriter:
    """Writes one shard under a temporary name, hashing as it goes; `finish()` publishes it."""

    def __init__(self, folder: Path, name: str) -> None:
        self.path = folder / name
        self.tmp = temp_path(self.path)
        self.file = self.tmp.open("wb")
        self.sha = hashlib.sha256()
        self.tokens = 0

    def write(self, tokens: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens, dtype="<u2").tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.tokens += len(tokens)

    def finish(self) -> dict[str, Any]:
        """Flush and rename to the final name; return the manifest entry."""
        self.file.close()
        rename_into_place(self.tmp, self.path)
        return {"file": self.path.name, "tokens": self.tokens, "sha256": self.sha.hexdigest()}

    def abandon(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


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
    if not manifest["train"]:
        raise UserError(f"{folder} holds no training tokens; {redo}")
    train = [_open(folder, entry, redo) for entry in manifest["train"]]
    val = _open(folder, manifest["val"], redo)
    return Shards(folder, manifest, train, val)
