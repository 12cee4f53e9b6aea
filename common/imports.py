"""An entry point's heavy imports (torch, dynamo, accelerate), kept out of the garbage collector's way."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def imports_for_good() -> Iterator[None]:
    """Import an entry point's machinery inside this block.

    Those objects live as long as the process, yet every full collection scans them again. torch, dynamo and
    accelerate make about 370,000; a small run spent 1.0 of its 7 CPU-seconds collecting, 0.9 of it in 8 full
    passes. So the collector is off during the imports, and their objects are then set aside for good (`gc.freeze`).
    What the run makes later is collected as usual.

    Only a process's first block freezes. A test that runs train.py's entry point in its own process runs it again:
    by then an earlier run's leftovers may be waiting for the collector, and they must stay collectable."""
    if gc.get_freeze_count():
        yield
        return
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()
