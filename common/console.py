"""Progress on a terminal, plain lines everywhere.

A live progress bar redraws itself with `\\r`: on a terminal that is what a user wants to watch, in a
log file it is one endless line. So bars are drawn only when stderr is a terminal, and whatever must
be read later (a logged step, an evaluation's result) is printed as a plain line.
"""
from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm


class TerminalBar(tqdm):
    """A tqdm bar, drawn only where tqdm itself draws one (`disable=None`: its output, stderr, is a terminal) and
    when `show` (e.g. on the main process).

    `write` prints a plain line above the bar (or just the line, when no bar is drawn) and flushes it:
    redirected stdout is block-buffered, and `tail -f` on a log should show a line when it is written."""

    def __init__(self, *args: Any, show: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, disable=None if show else True, **kwargs)

    @classmethod
    def write(cls, s: str, file: TextIO | None = None, end: str = "\n", nolock: bool = False) -> None:
        super().write(s, file=file, end=end, nolock=nolock)
        (file or sys.stdout).flush()
