"""Where a run's wall time goes: the step, waiting for data, evaluations, checkpoints, and the rest.

`RunClock` adds up this process's seconds by phase (`with clock.phase(DATA): ...`); what is not inside a phase is
"other" (setup, logging, the export). It feeds three things, whose names are a contract (README, "Run folder"):
- `metrics.jsonl` per logged step: `data_wait_s`, the seconds the slowest rank waited for its batches over the
  steps since the last logged one (the step starts when every rank has its batches, so the slowest one counts);
  on the steps they happen, `eval_s` (the evaluations after the step) and `checkpoint_s` (its save);
- the log line: ` | data 7%` when the wait is more than `SHOW_DATA_ABOVE` of the logged steps' time;
- the end of the run: one line splitting the wall time since the run started into the five.
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
        """Count the time inside the block as `name` (phases do not nest); the `Span` it gives holds the block's
        seconds once it has ended."""
        span, start = Span(), time.perf_counter()
        try:
            yield span
        finally:
            span.seconds = time.perf_counter() - start
            self.total[name] += span.seconds
            self._unread[name] += span.seconds

    def since_last(self, name: str) -> float:
        """Seconds of `name` since the last call for it (since the start for the first), then start over."""
        seconds, self._unread[name] = self._unread[name], 0.0
        return seconds

    def summary(self) -> str:
        """`time 0:02:47: step 81% | data 2% | evaluation 12% | checkpoint 4% | other 1%` (this process)."""
        wall = time.perf_counter() - self.start
        other = max(0.0, wall - sum(self.total.values()))
        shares = [(name, self.total[name]) for name in PHASES] + [("other", other)]
        return f"time {timedelta(seconds=round(wall))}: " + " | ".join(
            f"{name} {seconds / wall:.0%}" if wall else f"{name} -" for name, seconds in shares)
