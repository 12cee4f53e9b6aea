"""One optimizer step, its learning rate, and what follows a step that was not finite.

The batch is set in tokens (`total_batch_size`); the micro-steps follow from the micro-batch, the context and the
processes (`training.distributed.processes.BatchGeometry`). The learning rate is a function of the step alone: no
scheduler object to checkpoint, or to step the wrong number of times under accelerate.

A step never waits for the device. The loss and the gradient norm stay there; the host reads them only on the steps
that show them (a log line, an evaluation, a checkpoint). Only `--on_nan skip` reads the norm every step, since it
must decide before the update.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from accelerate import Accelerator

from common.errors import UserError
from common.run_dir import RunDir
from data.tokenizer import IGNORE
from training.distributed.pipeline import PipelinedGPT
from training.optimizers.spec import LR_OF


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup to the peak, then cosine decay to `min_lr_ratio` of it at `max_steps`. A factor of the peak:
    each optimizer multiplies its own peak LR by it (`OptimizerPlan.lrs_at`)."""

    warmup_steps: int
    max_steps: int
    min_lr_ratio: float

    def warmup_warning(self) -> str | None:
        """The warning for a warmup longer than the run, whose LR then never reaches its peak; None otherwise. Not a
        refusal: the default warmup outlasts a smoke run (`--max_steps 3`), which checks the pipeline, not the
        schedule."""
        if self.warmup_steps <= self.max_steps:
            return None
        return (f"--warmup_steps {self.warmup_steps} is longer than the run (--max_steps {self.max_steps}): the "
                f"learning rate never reaches its peak (it ends at {self.max_steps / self.warmup_steps:.0%} of it); "
                f"pass --warmup_steps {self.max_steps} or less (e.g. a tenth of the run) or a larger --max_steps for "
                "the schedule you meant")

    def factor(self, step: int) -> float:
        """The fraction of the peak learning rate at optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        return self.min_lr_ratio + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - self.min_lr_ratio)


def train_step(accelerator: Accelerator, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer],
               next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]], grad_accum: int, lrs: Sequence[float],
               grad_clip: float, masked_targets: bool = False,
               skip_nonfinite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step: `grad_accum` micro-steps, clipping to `grad_clip` (0: none, the norm still measured), and
    every optimizer's update at `lrs[i]`. Returns the summed micro-batch losses (divided by `grad_accum` and averaged
    over ranks: the step's loss) and the global gradient norm, both on the device. With `skip_nonfinite` a step with
    a non-finite norm is not applied, which reads the norm on the host. Otherwise the update is applied whatever the
    norm, and `NonFinitePolicy` stops the run before anything reads the weights.

    The gradient is that of the mean loss over every target token of the global batch. With `masked_targets` some
    targets are -100, so micro-batches hold different numbers of targets. The step's targets are then counted and
    all-reduced once, and each summed loss is scaled by world_size * grad_accum / global count: backward divides by
    grad_accum and DDP averages over ranks, which leaves sum / count. Without masking, the mean of the micro-batch
    means is that same mean, with no extra collective."""
    if isinstance(model, PipelinedGPT):  # the schedule runs the micro-batches through the stages
        loss_sum, norm = model.step(accelerator, [next_batch() for _ in range(grad_accum)], lrs, grad_clip,
                                    masked_targets)
        return loss_sum, torch.tensor(norm)
    set_learning_rates(optimizers, lrs)
    device = accelerator.device
    loss_sum = torch.zeros((), device=device)
    batches = (next_batch() for _ in range(grad_accum))
    scale = None
    if masked_targets:
        batches = list(batches)
        count = to_device(sum((y != IGNORE).sum() for _, y in batches), device)
        global_count = accelerator.reduce(count, reduction="sum")
        scale = accelerator.num_processes * grad_accum / global_count.clamp(min=1)
    for x, y in batches:
        with accelerator.accumulate(model):  # all-reduces gradients only on the last micro-step
            x, y = to_device(x, device), to_device(y, device)
            if scale is None:
                _, loss = model(x, y)
            else:
                _, loss = model(x, y, loss_reduction="sum")
                loss = loss * scale
            accelerator.backward(loss)  # divides by grad_accum: the step's gradient is the mean
        loss_sum += loss.detach()
    # The global norm, the same on every rank. --grad_clip 0 measures it without clipping: a max norm of inf scales by
    # exactly 1. DeepSpeed clipped inside backward already (its `gradient_clipping` 0 is off).
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
        grad_norm = grad_norm.full_tensor()
    apply = not skip_nonfinite or math.isfinite(float(grad_norm))
    for optimizer in optimizers:
        if apply:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss_sum, torch.as_tensor(grad_norm)


def set_learning_rates(optimizers: Sequence[torch.optim.Optimizer], lrs: Sequence[float]) -> None:
    """Set `lrs[i]` on the param groups of the plan's optimizer i. Where one optimizer stands for several
    (`OptimizerSpec.zero_build`), each group takes the LR of the one it names (`LR_OF`)."""
    if len(optimizers) == 1 and len(lrs) > 1:
        for group in optimizers[0].param_groups:
            group["lr"] = lrs[group[LR_OF]]
        return
    for optimizer, lr in zip(optimizers, lrs, strict=True):
        for group in optimizer.param_groups:
            group["lr"] = lr


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on `device` without waiting for the copy. To a GPU it goes from pinned memory, since a copy from
    pageable memory would block the host."""
    if device.type == "cuda" and not batch.is_pinned():
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)


class NonFinitePolicy:
    """`--on_nan`: what follows a step whose loss or gradient norm was not finite. `stop` names the last good
    checkpoint. `skip` skips the step, but at most `--max_nan_skips` in a row: a run whose every step is skipped is
    broken, not unlucky. The norm is global, so every rank decides alike.

    `stop` keeps the first bad step on the device, and `check` reads it before anything reads the weights or the
    loss. The run then stops naming that step, as if it had stopped at once. `skip` reads every step's norm."""

    def __init__(self, on_nan: str, max_nan_skips: int, run: RunDir, accelerator: Accelerator) -> None:
        self.on_nan, self.max_nan_skips, self.run, self.accelerator = on_nan, max_nan_skips, run, accelerator
        self.skipped_in_a_row = 0
        self.first_bad: torch.Tensor | None = None  # `stop`: the first non-finite step, 0 while there is none

    @property
    def skips(self) -> bool:
        return self.on_nan == "skip"

    def after_step(self, step: int, grad_norm: torch.Tensor | float) -> None:
        """`step`: the 1-based number of the step just run."""
        if not self.skips:
            norm = torch.as_tensor(grad_norm)
            bad = torch.where(torch.isfinite(norm), 0, step)
            self.first_bad = bad if self.first_bad is None else torch.where(self.first_bad > 0, self.first_bad, bad)
            return
        if math.isfinite(float(grad_norm)):
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        limit = self.max_nan_skips
        if self.skipped_in_a_row > limit:
            self._stop(step, f" ({self.skipped_in_a_row} steps in a row, over --max_nan_skips {limit})")
        self.accelerator.print(f"step {step}: non-finite gradient norm, step skipped ({self.skipped_in_a_row} in a "
                               f"row; --on_nan skip stops after {limit})")

    def check(self) -> None:
        """Under `stop`, end the run if any step so far was not finite. Reads one number from the device."""
        if self.first_bad is not None and (step := int(self.first_bad)) > 0:
            self._stop(step, "")

    def _stop(self, step: int, why: str) -> None:
        advice = "Lower --lr and resume from it" + ("" if self.skips else ", or resume with --on_nan skip")
        raise UserError(f"non-finite loss/gradient norm at step {step}{why}; last good checkpoint: "
                        f"{self.run.latest_checkpoint()}. {advice}", on_every_rank=True)
