"""One exception type for mistakes a user can fix, and the CLI wrapper that reports it.

Library code raises `UserError("what is wrong; what to do")`; entry points (`train.py`,
`python -m data.prepare`, `python -m eval.hellaswag`, ...) run under `run_cli`, which prints that
one line and exits with status 2 instead of showing a traceback from deep inside a library.

Under a multi-process launch every rank exits 2; an error that every rank raised alike (marked
`on_every_rank`) is printed by rank 0 only, so the user reads it once, and the other ranks wait for the launcher
to stop them once rank 0 has exited (see `_leave_the_report_to_rank_0`).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, NoReturn

from common.launch import started_by_a_launcher


class UserError(Exception):
    """A problem with the user's input or environment, with the fix in the message.

    `on_every_rank`: every process of a launch raises this same error (e.g. after the ranks agreed
    on it), so only rank 0 needs to print it."""

    def __init__(self, message: str, *, on_every_rank: bool = False) -> None:
        super().__init__(message)
        self.on_every_rank = on_every_rank


def json_problem(err: json.JSONDecodeError) -> str:
    """What is wrong with a line of JSON, where (`Invalid control character at column 301`): `err.msg` alone is cut
    before its position ("... at")."""
    return f"{err.msg.removesuffix(' at')} at column {err.colno}"


@contextmanager
def computed_alike_on_every_rank() -> Iterator[None]:
    """Mark the `UserError`s of a block that every rank computes alike, without talking to the others (e.g.
    parsing the same flags): each rank raises the same error, so rank 0 alone prints it. (A block whose ranks
    may disagree gathers their errors instead: `training.distributed.processes.shared_across_ranks`.)"""
    try:
        yield
    except UserError as err:
        err.on_every_rank = True
        raise


def launch_rank() -> int:
    """This process's global rank under torchrun / accelerate launch (0 without a launcher, whatever RANK a shell left
    in the environment: that process is alone, and must print its own errors)."""
    return int(os.environ.get("RANK", "0")) if started_by_a_launcher() else 0


def print_error(message: str) -> None:
    """Print `error: message` to stderr, the one form every error line takes. One write, its newline included:
    `print` writes the text and the newline apart, and on an unbuffered stderr shared with other processes (an
    elastic agent's, a peer's) another line could land between them (seen in CI: the agent's warning glued to ours)."""
    try:
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
    except OSError:  # stderr is a closed pipe: the exit status still tells
        pass
    tell_the_elastic_agent(f"error: {message}")


def tell_the_elastic_agent(line: str) -> None:
    """Under torch's elastic agent (torchrun; `accelerate launch` of several processes), write `line` into the error
    file it gave this process (TORCHELASTIC_ERROR_FILE, in the format of torch's own `@record`), so that the failure
    report the launcher ends with shows it as the root cause (`traceback : error: ...`, its last line before the
    closing border) instead of "To enable traceback see: ...". The launcher's own traceback before that report stays:
    accelerate re-raises the agent's ChildFailedError, and no flag of its changes that (docs/faults.md). The report's
    root cause is the failure with the earliest timestamp: this process's, which fails before the agent stops the
    others (tests: an error of every rank, printed by rank 0; an error of rank 1 alone, test_elastic.py).
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = str(int(time.time()))
    report = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": now}}}
    try:
        with open(path, "w") as f:
            json.dump(report, f)
    except OSError:  # the agent's folder is gone: its report says less, the line above still stands
        pass


def fail(message: str, *, quiet: bool = False) -> NoReturn:
    """Print `error: message` to stderr (unless `quiet`) and exit with status 2."""
    if not quiet:
        print_error(message)
    raise SystemExit(2)


def run_cli(main: Callable[[], object]) -> None:
    """Run an entry point, turning a `UserError` into a one-line message and exit status 2. Into a log (stderr not
    a terminal), the libraries' own progress bars (transformers' "Writing model shards", huggingface_hub's
    downloads) are turned off: their `\r` redraws would fill it."""
    if not sys.stderr.isatty():
        _no_library_progress_bars()
    try:
        main()
    except UserError as err:
        rank = launch_rank()
        if err.on_every_rank and rank != 0:
            _leave_the_report_to_rank_0()
        if err.on_every_rank or rank == 0:
            fail(str(err), quiet=rank != 0)
        fail(f"(rank {rank}) {err}")
    except KeyboardInterrupt as err:  # Ctrl-C; a run's second Ctrl-C says what it kept (training.preemption)
        fail(str(err) or "interrupted")


# The longest a quiet rank waits for rank 0 to print an error they share; rank 0 normally prints it within a second
# of the others, and the launcher stops the waiting ranks as soon as rank 0 has exited.
REPORT_WAIT_S = 60


def _leave_the_report_to_rank_0() -> None:
    """A rank other than 0 holding an error that rank 0 prints: wait until the launcher stops it (SIGTERM, once rank
    0 has exited), at most `REPORT_WAIT_S`. Exiting at once, a quick rank made torchrun's agent stop a slower rank 0
    before it had printed the line, and the user read no error at all (seen on a busy 2-core machine)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the run's preemption handler would only set a flag
    time.sleep(REPORT_WAIT_S)


def _no_library_progress_bars() -> None:
    if "huggingface_hub" in sys.modules:
        import huggingface_hub.utils

        huggingface_hub.utils.disable_progress_bars()
    else:  # read when it is imported: a command that answers at once (`train.py --help`) never pays its 0.1 s
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # imported by the CLIs that save models through it (2 s to import otherwise)
        import transformers.utils.logging

        transformers.utils.logging.disable_progress_bar()
