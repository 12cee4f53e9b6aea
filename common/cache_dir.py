"""This project's folder of files it can always rebuild, kept between runs so that it need not.

`GPT2_ACCELERATE_CACHE` if set, else `$XDG_CACHE_HOME/gpt2-accelerate`, else `~/.cache/gpt2-accelerate`. Deleting it
is always safe: what is missing is built again when next needed."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "GPT2_ACCELERATE_CACHE"


def cache_dir() -> Path:
    """The folder (not created here)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt2-accelerate"
