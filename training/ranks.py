"""Agreement between the processes of a launch: a failure on one rank becomes the same error on all.

Without it, a rank that finds a problem (a damaged file of its own, a data source it cannot read)
exits while the others wait for it in their next collective until a timeout, and the user reads
a distributed-timeout traceback instead of the problem.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from accelerate import Accelerator
from accelerate.utils import gather_object

from common.errors import UserError


@contextmanager
def same_outcome_on_every_rank(accelerator: Accelerator) -> Iterator[None]:
    """Run a block on every rank; if it raised a `UserError` on any rank, raise the first (lowest rank's)
    message on every rank, marked for printing once. The block must not run collectives itself (a rank that
    failed early would not join them)."""
    error: UserError | None = None
    try:
        yield
    except UserError as err:
        error = err
    if accelerator.num_processes == 1:
        if error is not None:
            raise error
        return
    messages = [m for m in gather_object([None if error is None else str(error)]) if m is not None]
    if messages:
        raise UserError(messages[0], on_every_rank=True) from error
