"""A step's batches, drawn before its first forward, and what every rank does when one rank cannot read its data.

A streamed dataset can fail to be read after its retries (`data.streaming.DataUnavailable`: the Hub down for
minutes). Drawn inside the step, the failure would stop one rank between micro-steps while the others wait
in the gradient all-reduce. Drawn first, it is known before any collective of the step; the ranks agree on it
(one scalar all-reduce per step) and all stop after the last completed step, which they save first.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from accelerate import Accelerator

from common.errors import UserError
from data.streaming import DataUnavailable
from training.resume import Progress

Batch = tuple[torch.Tensor, torch.Tensor]


def draw_step(accelerator: Accelerator, next_batch: Callable[[], Batch], n: int) -> list[Batch] | None:
    """The step's `n` micro-batches of this rank, or None on every rank when any rank's data could not be read."""
    batches: list[Batch] = []
    try:
        batches = [next_batch() for _ in range(n)]
    except DataUnavailable as err:
        print(f"rank {accelerator.process_index}: {err}", flush=True)
    failed = torch.tensor([0.0 if len(batches) == n else 1.0], device=accelerator.device)
    return None if accelerator.reduce(failed, reduction="sum").item() > 0 else batches


def data_unavailable(progress: Progress, saved: Path | None) -> UserError:
    """The one line that ends a run whose data could not be read: where it stopped and how to go on."""
    if saved is None:
        return UserError("the training data could not be read before the first step (see the line above); rerun "
                         "when the Hub answers again", on_every_rank=True)
    return UserError(f"the training data could not be read (see the line above); step {progress.step} is saved in "
                     f"{saved}: continue with --resume latest when the Hub answers again", on_every_rank=True)
