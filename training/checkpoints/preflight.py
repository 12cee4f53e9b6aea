"""Checks of the run folder's filesystem before any training time is spent.

`check_out_dir_writable` refuses an `--out_dir` that cannot be written; `warn_if_low_disk` warns when the free space
looks too small for the checkpoints the run keeps. Neither leaves anything behind, and neither creates `out_dir`:
the run folder is made only once a resume is accepted.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from common.errors import UserError

# fp32 weights (4 bytes a parameter) and AdamW's two fp32 moments (8); 4 more cover the other files and overhead.
BYTES_PER_PARAM = 16
# Room beyond the `keep_last` kept: the checkpoint being written (and the one it replaces, until the rename) and
# `final/`, about two more.
EXTRA_CHECKPOINTS = 2


def nearest_existing(path: str | Path) -> Path:
    """`path` itself if it exists, else its closest existing ancestor (the folder a mkdir would write into)."""
    current = Path(path).expanduser().absolute()
    while not current.exists():
        current = current.parent  # the root always exists, so this ends
    return current


def check_out_dir_writable(out_dir: str | Path) -> None:
    """Raise UserError unless a file can be created in `out_dir`, or in the nearest existing folder above it. A
    temporary file is created and deleted: unlike `os.access`, that catches read-only mounts, also for root."""
    folder = nearest_existing(out_dir)
    if not folder.is_dir():
        raise UserError(f"--out_dir {out_dir}: {folder} is a file, so the run folder cannot be created there; "
                        "choose another --out_dir")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
    except OSError as err:
        raise UserError(f"--out_dir {out_dir}: cannot write to {folder} ({err.strerror or err}); make it writable "
                        "or choose another --out_dir") from None
    os.close(fd)
    os.unlink(probe)


def checkpoint_bytes(n_params: int) -> int:
    """The estimated size of one checkpoint of a model with `n_params` parameters."""
    return BYTES_PER_PARAM * n_params


def warn_if_low_disk(out_dir: str | Path, bytes_per_checkpoint: int, keep_last: int) -> str | None:
    """Print to stderr and return a warning when `out_dir`'s filesystem has less free space than
    `keep_last + EXTRA_CHECKPOINTS` checkpoints need; None when there is enough. Never raises: the estimate is
    rough (it ignores checkpoints a resumed run already holds), so the run goes on. Call it on one process per
    filesystem."""
    folder = nearest_existing(out_dir)
    free = shutil.disk_usage(folder).free
    needed = (keep_last + EXTRA_CHECKPOINTS) * bytes_per_checkpoint
    if free >= needed:
        return None
    message = (f"only {free / 1e9:.2f} GB free in {folder}, but {keep_last} kept checkpoints + {EXTRA_CHECKPOINTS} "
               f"more while saving need about {needed / 1e9:.2f} GB ({bytes_per_checkpoint / 1e9:.2f} GB each); free "
               "some space, lower --keep_last or choose another --out_dir, or the run may stop at a save")
    print(f"warning: {message}", file=sys.stderr, flush=True)
    return message
