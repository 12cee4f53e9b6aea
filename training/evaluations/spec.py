"""What an in-training evaluation declares (`EvaluationSpec`). `training.evaluations.runner.TrainingEvals` runs
them; the memory planner and the model card read them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from accelerate import Accelerator

from configs import EvalConfig
from data.source import DataSource


@dataclass(frozen=True)
class Metric:
    """A metrics.jsonl key an evaluation logs, and how the model card shows it."""

    key: str  # the metrics.jsonl / tracker key (a contract)
    label: str  # its row in the card's results table
    panel: str  # the loss_curve.png panel it is drawn in ("loss": beside the train loss)
    unit: str  # that panel's y axis
    line: str  # its legend


@dataclass(frozen=True)
class Context:
    """What every evaluation may read of the run."""

    cfg: EvalConfig
    source: DataSource  # the run's data (its validation split)
    block_size: int
    seed: int  # the run's --seed (a sample drawn from it)
    accelerator: Accelerator  # its data-parallel ranks (`tensor_parallel.evaluation_ranks`)


@dataclass(frozen=True)
class EvaluationSpec:
    """One evaluation, as the run, the memory planner and the model card see it.

    Invariant: `score` runs on every rank (sharded forwards need them all) and returns the same values on each."""

    name: str  # its phase in the memory plan ("validation", "hellaswag")
    display: str  # how the plan's header names it
    flags: tuple[str, ...]  # the EvalConfig fields (flags) it reads besides --eval_batch_size
    metrics: tuple[Metric, ...]
    every: Callable[[EvalConfig], int]  # its period in steps (0: off); it runs at the last step too
    load: Callable[[Context], Any]  # its data, once before the first step: bad data is refused here
    # (model without wrappers, its data, the context, bf16 autocast) -> its metrics, and text to print under them
    score: Callable[[torch.nn.Module, Any, Context, bool], tuple[dict[str, float], str | None]]
    planned: Callable[[int, int], tuple[int, int, str]]  # (eval batch, block size) -> rows, tokens, what: its forward
    cpu_process_bytes: int = 0  # what loading it adds to a CPU process's resident set (the planner)
