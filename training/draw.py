"""A step's batches, drawn before its first forward, and what every rank does when one rank cannot read its data.

A streamed dataset can fail after its retries (`data.streaming.DataUnavailable`: the Hub down for minutes). Inside
the step, that would stop one rank between micro-steps while the others wait in the gradient all-reduce. Drawn
first, the failure is known before any collective. The ranks agree on it (one host-side all-reduce per step) and
all stop after saving the last completed step.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import torch
from accelerate import Accelerator

from common.errors import UserError
from data.streaming import DataUnavailable
from training.checkpoints.resume import Progress
from training.distributed.processes import any_rank

Batch = tuple[torch.Tensor, torch.Tensor]


class Loader(Protocol):
    def next_batch(self) -> Batch: ...

    def state_dict(self) -> dict: ...


def draw_step(accelerator: Accelerator, loader: Loader, n: int, progress: Progress,
              save: Callable[[dict], Path]) -> list[Batch]:
    """This rank's `n` micro-batches for the step. If any rank's data could not be read, every rank saves the last
    completed step, with the loader's state from before this step, and raises the line that ends the run."""
    before = loader.state_dict()
    batches: list[Batch] = []
    try:
        batches = [loader.next_batch() for _ in range(n)]
    except DataUnavailable as err:
        print(f"rank {accelerator.process_index}: {err}", flush=True)
    if any_rank(len(batches) != n, accelerator):
        raise data_unavailable(progress, save(before) if progress.step else None)
    return batches


def data_unavailable(progress: Progress, saved: Path | None) -> UserError:
    """The one line that ends a run whose data could not be read: where it stopped and how to go on."""
    if saved is None:
        return UserError("the training data could not be read before the first step (see the line above); rerun "
                         "when the Hub answers again", on_every_rank=True)
    return UserError(f"the training data could not be read (see the line above); step {progress.step} is saved in "
                     f"{saved}: continue with --resume latest when the Hub answers again", on_every_rank=True)
