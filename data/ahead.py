"""Work done ahead of the one who needs it: a background thread that keeps the next few items ready.

`Ahead(produce, depth)` calls `produce()` again and again in one thread and keeps at most `depth` results
waiting; `next()` hands them out in the order they were made. Invariants:
- nothing is skipped or reordered: what `produce` raised is raised by the `next()` that would have returned its
  item, after every item made before it, and the thread stops there (every later `next()` raises it again);
- all calls of `produce` (and of `finish`, once, when the thread ends) run in that thread, one at a time, so the
  state they share (an open dataset iterator) is never touched by two threads at once;
- `close()` stops the thread after the call it is in (it finishes the item it is making) and waits for it.

A thread, not a process: the work it is made for (`datasets` reading, tiktoken encoding) is I/O and Rust code that
releases the GIL, and a thread shares the producer's state, which keeps a loader's resume exact without shipping
iterator states between processes (data/streaming.py). `Inline` has the same calls and does the work when asked.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")
CLOSE_WAIT_S = 30.0  # at most this long for the item being made when close() is called (a retried Hub read)
_POLL_S = 0.1


class Inline(Generic[T]):
    """`produce()` when the item is asked for: nothing ahead."""

    def __init__(self, produce: Callable[[], T], finish: Callable[[], None] | None = None) -> None:
        self._produce, self._finish = produce, finish

    def next(self) -> T:
        return self._produce()

    def close(self) -> None:
        if self._finish is not None:
            self._finish()
            self._finish = None


class Ahead(Generic[T]):
    """`produce()`'s results made in a background thread, at most `depth` waiting (see the module docstring)."""

    def __init__(self, produce: Callable[[], T], depth: int, finish: Callable[[], None] | None = None,
                 name: str = "ahead") -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self._queue: queue.Queue[tuple[T | None, BaseException | None]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(produce, finish), name=name, daemon=True)
        self._thread.start()

    def _run(self, produce: Callable[[], T], finish: Callable[[], None] | None) -> None:
        try:
            while not self._stop.is_set():
                try:
                    item: tuple[T | None, BaseException | None] = (produce(), None)
                except BaseException as err:  # noqa: BLE001 (handed to the consumer, in its place)
                    item = (None, err)
                if not self._put(item) or item[1] is not None:
                    return
        finally:
            if finish is not None:
                finish()

    def _put(self, item: tuple[T | None, BaseException | None]) -> bool:
        """Queue `item`, waiting for room; False when closed meanwhile."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> T:
        """The next item, waiting for it to be made; raises what its `produce()` raised."""
        if self._error is not None:
            raise self._error
        item, err = self._queue.get()
        if err is not None:
            self._error = err
            raise err
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """Stop making items and wait (at most `CLOSE_WAIT_S`) for the thread to end; the items made are dropped."""
        self._stop.set()
        while True:  # room for a blocked put, which then sees the stop
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(CLOSE_WAIT_S)
