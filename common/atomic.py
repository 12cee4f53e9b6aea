"""Write-then-rename: a file or folder is either absent, the old version, or the complete new one.

Writers build under a temporary name beside the destination (so the rename stays on one
filesystem), flush it to disk and only then move it into place. Readers that look only at final
names can never pick up a half-written result after a crash, a kill or a full disk.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from common.errors import UserError

TEMP_PREFIX = ".tmp-"  # temporary names start with a dot: listings of final names never match them
PLAIN_MODE = 0o666  # what open() gives a new file before the umask: every file a run writes gets it


def current_umask() -> int:
    """The process's umask (Linux: read from /proc, which leaves it as it is; elsewhere set and set back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_path(final: Path) -> Path:
    """Where `final` is built before `rename_into_place` moves it there."""
    return final.with_name(TEMP_PREFIX + final.name)


def fresh_temp_dir(final: Path) -> Path:
    """An empty temporary folder for `final` (debris of an earlier attempt that crashed is removed)."""
    tmp = temp_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def fsync_dir(folder: Path) -> None:
    """Make renames inside `folder` durable (not every OS lets a directory be opened for that)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_into_place(tmp: Path, final: Path) -> None:
    """Flush `tmp` (a file, or a folder and everything in it) and rename it to `final`.

    An existing `final` folder is set aside first and deleted only once the new one is in place,
    so a crash at any point leaves the old or the new version under the final name, never neither
    for longer than one rename."""
    paths = [tmp] if tmp.is_file() else [p for p in tmp.rglob("*") if p.is_file()]
    plain = PLAIN_MODE & ~current_umask()
    for path in paths:  # libraries (save_state, save_pretrained) write without fsync
        _fsync_file(path)
        if path.stat().st_mode & 0o777 != plain:
            os.chmod(path, plain)  # safetensors creates its files 0600: teammates on a shared --out_dir read them
    aside = final.with_name(".old-" + final.name)
    if final.is_dir():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in blocks: how a manifest (a checkpoint's, a data folder's) records what
    was written, and how a reader checks it is still there."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json_atomic(path: Path, obj: Any, indent: int = 1) -> None:
    """Replace `path` with `obj` as JSON, atomically. A failed write (a full disk) leaves no temporary file."""
    tmp = temp_path(path)
    try:
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(obj, f, indent=indent)
        rename_into_place(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def nearest_existing(path: str | Path) -> Path:
    """`path` itself if it exists, else its closest existing ancestor (the folder a mkdir would write into)."""
    current = Path(path).expanduser().absolute()
    while not current.exists():
        current = current.parent  # the root always exists, so this ends
    return current


def check_folder_writable(path: str | Path, flag: str, what: str = "folder") -> None:
    """Raise UserError unless a file can be created in folder `path`, or in the nearest existing folder above it:
    the one line for an output folder (`flag`, e.g. --out_dir; `what` it is) that is a file, lies under a file, or
    cannot be written. A temporary file is created and deleted: unlike `os.access`, that catches read-only mounts,
    also for root. Creates nothing."""
    folder = nearest_existing(path)
    if not folder.is_dir():
        raise UserError(f"{flag} {path}: {folder} is a file, so the {what} cannot be created there; "
                        f"choose another {flag}")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
    except OSError as err:
        raise UserError(f"{flag} {path}: cannot write to {folder} ({err.strerror or err}); make it writable "
                        f"or choose another {flag}") from None
    os.close(fd)
    os.unlink(probe)


def write_failure(err: BaseException) -> str | None:
    """Why a file could not be written, in a few words, when `err` is a failed write; None for anything else (a
    bug: let it raise). A full disk (or a file-size limit, an unwritable folder) surfaces as an OSError, as
    safetensors' SafetensorError ("Error while serializing: I/O error: ..."), or as torch's serializer RuntimeError,
    which carries no errno ("[enforce fail at inline_container.cc:...] . unexpected pos ...", "PytorchStreamWriter
    failed writing file ...")."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if type(err).__name__ == "SafetensorError" and "I/O error: " in first:
        return first.split("I/O error: ", 1)[1]
    if isinstance(err, RuntimeError) and ("inline_container.cc" in first or "PytorchStreamWriter failed" in first):
        return f"torch's writer failed, most often on a full disk: {first[:120]}"
    return None
