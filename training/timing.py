"""Where a run's wall time goes: the step, waiting for data, evaluations, checkpoints, and the rest.

`RunClock` adds up this process's seconds by phase; time outside a phase is "other" (setup, logging, the export).
It feeds three things, whose names are a contract (README, "Run folder"):
- `metrics.jsonl`: `data_wait_s` per logged step, the slowest rank's wait since the last logged step (the step
  starts when every rank has its batches). On the steps they happen, `eval_s` and `checkpoint_s`.
- the log line: ` | data 7%` when the wait is over `SHOW_DATA_ABOVE` of the steps' time;
- the end of the run: one line splitting its wall time into the five.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

STEP, DATA, EVAL, CHECKPOINT = "step", "data", "evaluation", "checkpoint"
PHASES = (STEP, DATA, EVAL, CHECKPOINT)
SHOW_DATA_ABOVE = 0.03  # the log line names the data wait above this share of the steps' time


@dataclass
class Span:
    """The seconds of one timed block (0 until it ends)."""

    seconds: float = 0.0


class RunClock:
    """Seconds by phase since the clock was made, and since the last `since_last` of each phase."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.total = dict.fromkeys(PHASES, 0.0)
        self._unread = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[Span]:
        """Count the block's time as `name`; phases do not nest. The `Span` holds the seconds once the block ends."""
        span, start = Span(), time.perf_counter()
        try:
            yield span
        finally:
            span.seconds = time.perf_counter() - start
            self.total[name] += span.seconds
            self._unread[name] += span.seconds

    def since_last(self, name: str) -> float:
        """Seconds of `name` since the last call for it, then start over."""
        seconds, self._unread[name] = self._unread[name], 0.0
        return seconds

    def summary(self) -> str:
        """`time 0:02:47: step 81% | data 2% | evaluation 12% | checkpoint 4% | other 1%` (this process)."""
        wall = time.perf_counter() - self.start
        other = max(0.0, wall - sum(self.total.values()))
        shares = [(name, self.total[name]) for name in PHASES] + [("other", other)]
        return f"time {timedelta(seconds=round(wall))}: " + " | ".join(
            f"{name} {seconds / wall:.0%}" if wall else f"{name} -" for name, seconds in shares)
