"""What an in-training evaluation declares (`EvaluationSpec`). `training.evaluations.runner.TrainingEvals` runs
them; the memory planner, the model card and the run's last line read them.

A spec and its flags stay free of torch: train.py's command line reads them before torch loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:  # annotations only
    import torch
    from accelerate import Accelerator

    from data.source import DataSource


@dataclass(frozen=True)
class Metric:
    """A metrics.jsonl key an evaluation logs, and how the model card shows it."""

    key: str  # the metrics.jsonl / tracker key (a contract)
    label: str  # its row in the card's results table, and its name in the run's last line
    panel: str  # the loss_curve.png panel it is drawn in ("loss": beside the train loss)
    unit: str  # that panel's y axis
    line: str  # its legend


@dataclass(frozen=True)
class Context:
    """What one evaluation may read of the run: its own flags and the run's data and shape."""

    flags: Any  # its own flags, parsed (`EvaluationSpec.flags`); None where it declares none
    batch_size: int  # --eval_batch_size: sequences or items per forward, shared by every evaluation
    source: DataSource  # the run's data (its validation split)
    block_size: int
    seed: int  # the run's --seed (a sample drawn from it)
    accelerator: Accelerator  # its data-parallel ranks (`tensor_parallel.evaluation_ranks`)


@dataclass(frozen=True)
class EvaluationSpec:
    """One evaluation, as the run, the memory planner, the model card and the run's last line see it.

    Invariant: `score` runs on every rank (sharded forwards need them all) and returns the same values on each."""

    name: str  # its phase in the memory plan and its flag group ("validation", "hellaswag")
    display: str  # how the plan's header names it
    metrics: tuple[Metric, ...]
    every: Callable[[Any], int]  # its period in steps, from its flags (0: off); it runs at the last step too
    load: Callable[[Context], Any]  # its data, once before the first step: bad data is refused here
    # (model without wrappers, its data, the context, bf16 autocast) -> its metrics, and text to print under them
    score: Callable[[torch.nn.Module, Any, Context, bool], tuple[dict[str, float], str | None]]
    planned: Callable[[int, int], tuple[int, int, str]]  # (eval batch, block size) -> rows, tokens, what: its forward
    # Its own flags (`--hellaswag_every`, ...): a dataclass of `common.resume_rules.flag` fields that checks its
    # values. Registering adds them to train.py's flags; `Context.flags` carries the parsed values.
    flags: type | None = None
    card_note: str | None = None  # the card's words on how its metrics are scored, where the run logged them
    # (run folder, its flags) -> the command that scores the final model on its own, for the run's last line
    next_command: Callable[[str, Any], str] | None = None
    cpu_process_bytes: int = 0  # what loading it adds to a CPU process's resident set (the planner)

    def flags_in(self, parsed: Mapping[str, Any]) -> Any:
        """Its flags among a run's parsed flag groups (`TrainConfig.added`), by its name; their defaults where the
        groups were parsed before it was registered; None where it declares none."""
        if self.flags is None:
            return None
        return parsed[self.name] if self.name in parsed else self.flags()
