"""Checks of the run folder's filesystem before any training time is spent.

`check_out_dir_writable` refuses a run whose `--out_dir` cannot be written (one line naming the folder);
`warn_if_low_disk` warns when the free space looks too small for the checkpoints the run will hold.
Neither creates or leaves anything: the write test removes its own temporary file, and `out_dir`
itself is not created (the run folder is made only once a resume was accepted).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from common.atomic import check_folder_writable, nearest_existing

# fp32 weights (4 bytes a parameter) and AdamW's two fp32 moments (8); 4 more cover the other files and overhead.
BYTES_PER_PARAM = 16


def check_out_dir_writable(out_dir: str | Path) -> None:
    """Raise UserError unless a file can be created in `out_dir`, or in the nearest existing folder above it
    (`common.atomic.check_folder_writable`: the same line `python -m data.prepare --out` gives)."""
    check_folder_writable(out_dir, "--out_dir", "run folder")


def checkpoint_bytes(n_params: int) -> int:
    """The estimated size of one checkpoint of a model with `n_params` parameters."""
    return BYTES_PER_PARAM * n_params


def saves_ahead(start: int, max_steps: int, save_every: int) -> int:
    """How many checkpoints a run from step `start` to `max_steps` saves: every `save_every` steps and at the last."""
    if start >= max_steps:
        return 0
    return max_steps // save_every - start // save_every + (1 if max_steps % save_every else 0)


def held_at_once(saves: int, keep_last: int) -> tuple[int, str]:
    """The most checkpoint-sized folders a run that saves `saves` checkpoints holds at once, and what they are: those
    it keeps (at most `keep_last`), one more while a save replaces the oldest (only once it has more than it keeps),
    and `final/` (a quarter of a checkpoint, counted as one)."""
    kept = min(saves, keep_last)
    replacing = saves > keep_last
    what = (f"{kept} kept checkpoint{'s' if kept != 1 else ''} (of {saves} saved, --keep_last {keep_last})"
            + (" + 1 while a save replaces the oldest" if replacing else "") + " + final/")
    return kept + replacing + 1, what


def warn_if_low_disk(out_dir: str | Path, bytes_per_checkpoint: int, keep_last: int, saves: int) -> str | None:
    """Print (to stderr) and return a warning when the filesystem of `out_dir` has less free space than the
    checkpoints a run that saves `saves` of them holds at once (`held_at_once`: a short run never reaches
    `keep_last`); None when there is enough. Never raises for low space: the estimate is rough (it also ignores
    checkpoints a resumed run already holds), so the run goes on. Call it on one process per filesystem, e.g. the
    main one."""
    folder = nearest_existing(out_dir)
    free = shutil.disk_usage(folder).free
    count, what = held_at_once(saves, keep_last)
    needed = count * bytes_per_checkpoint
    if free >= needed:
        return None
    message = (f"only {free / 1e9:.2f} GB free in {folder}, but {what} need about {needed / 1e9:.2f} GB "
               f"({bytes_per_checkpoint / 1e9:.2f} GB each); free some space, lower --keep_last or choose another "
               "--out_dir, or the run may stop at a save")
    print(f"warning: {message}", file=sys.stderr, flush=True)
    return message
