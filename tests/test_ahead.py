"""data.ahead: items made in a background thread come out in order, errors in their place, and close() stops it.

At most `depth` items ahead; an error comes in its place and again after; `close()` runs `finish` once, in the thread.

Seen to catch: `finish` not called when the thread ends (the stream left open):
`test_close_stops_the_thread_and_finish_runs_once_in_it` fails."""
from __future__ import annotations

import threading
import time

import pytest

from data.ahead import Ahead, Inline


def counter(fail_at: int | None = None):
    made, threads = [], set()

    def produce() -> int:
        threads.add(threading.current_thread().name)
        if len(made) == fail_at:
            raise OSError(f"read {fail_at} failed")
        made.append(len(made))
        return made[-1]

    return produce, made, threads


@pytest.mark.parametrize("depth", [1, 3])
def test_items_come_in_order_and_at_most_depth_are_made_ahead(depth):
    produce, made, threads = counter()
    ahead = Ahead(produce, depth, name="t-ahead")
    assert [ahead.next() for _ in range(5)] == [0, 1, 2, 3, 4]
    time.sleep(0.3)
    assert len(made) <= 5 + depth + 1  # the waiting ones, and one made while waiting for room
    ahead.close()
    assert threads == {"t-ahead"}


def test_an_error_comes_after_the_items_made_before_it_and_stays():
    produce, _, _ = counter(fail_at=2)
    ahead = Ahead(produce, 4)
    assert [ahead.next(), ahead.next()] == [0, 1]
    for _ in range(2):
        with pytest.raises(OSError, match="read 2 failed"):
            ahead.next()
    ahead.close()


def test_close_stops_the_thread_and_finish_runs_once_in_it():
    produce, made, _ = counter()
    finished = []
    ahead = Ahead(produce, 2, finish=lambda: finished.append(threading.current_thread().name), name="t-close")
    ahead.next()
    ahead.close()
    count = len(made)
    time.sleep(0.3)
    assert len(made) == count and finished == ["t-close"] and not ahead._thread.is_alive()


def test_inline_makes_each_item_when_asked():
    produce, made, threads = counter()
    inline = Inline(produce)
    assert [inline.next(), inline.next()] == [0, 1] and made == [0, 1]
    assert threads == {threading.current_thread().name}
