"""One exception type for mistakes a user can fix, and the CLI wrapper that reports it.

Library code raises `UserError("what is wrong; what to do")`; entry points (`train.py`,
`python -m data.prepare`, `python -m eval.hellaswag`, ...) run under `run_cli`, which prints that
one line and exits with status 2 instead of showing a traceback from deep inside a library.
"""
from __future__ import annotations

import sys
from typing import Callable, NoReturn


class UserError(Exception):
    """A problem with the user's input or environment, with the fix in the message."""


def fail(message: str) -> NoReturn:
    """Print `error: message` to stderr and exit with status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def run_cli(main: Callable[[], object]) -> None:
    """Run an entry point, turning a `UserError` into a one-line message and exit status 2."""
    try:
        main()
    except UserError as err:
        fail(str(err))
    except KeyboardInterrupt:
        fail("interrupted")
