"""What an optimizer declares to take part in a run, and the run's resolved choice of optimizers.

AdamW is the base of every run: it trains whatever no other optimizer claims. An optimizer module declares an
`OptimizerSpec`: the parameters it claims (`claims`), how it is built, its learning rate, its state (which the
memory planner adds up), what the run's header says of it, and the engines it does not run under (which the
support table shows and the refusals read). `OptimizerPlan` is `--optimizer` resolved for one run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from training.engine_names import Refusal

# What an optimizer may claim beside AdamW: the 2-D weights inside the transformer blocks (`transformer.h.*`: the
# attention and MLP projections). The planner counts them as `ParamCounts.block_matrices`.
BLOCK_MATRICES = "the blocks' 2-D weights"


def claimed_names(model: torch.nn.Module, claims: str | None) -> list[str]:
    """The names of the trainable parameters `claims` means in `model` (none for None: AdamW trains them all)."""
    if claims is None:
        return []
    if claims != BLOCK_MATRICES:
        raise ValueError(f"unknown parameter set {claims!r}")
    return [name for name, p in model.named_parameters()
            if p.requires_grad and p.dim() == 2 and name.startswith("transformer.h.")]


@dataclass(frozen=True)
class StepPlacement:
    """What a run's engine and compile setting offer an optimizer's step beyond its parameters (`OptimizerSpec.place`;
    `training.prepare.step_placement` reads it from the prepared model). The default: one process, eager."""

    # The process group whose ranks hold the same averaged gradients of the same whole parameters when the step runs
    # (DDP: its group; a pipeline stage: its replicas), over which an optimizer may split work and gather the
    # results; None: no such group (one process, or parameters sharded by FSDP2 or tensor parallelism).
    group: object = None
    ranks: int = 1  # the group's size
    compile_backend: str | None = None  # torch.compile's backend where the run compiles its model; None: eager


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer, as the run, the planner, the checkpoints and the support table see it.

    Invariant: `claims` is None only for AdamW, the base that trains every parameter no other optimizer claims."""

    name: str  # --optimizer's value; checkpoints record it (accelerate saves the second optimizer as optimizer_1.bin)
    display: str  # how the run's header names it
    claims: str | None  # BLOCK_MATRICES, or None (AdamW: everything)
    state_bytes: int  # bytes of optimizer state per parameter it trains (AdamW: 8, two fp32 moments)
    build: Callable[[list[torch.nn.Parameter], OptimizerPlan, str], torch.optim.Optimizer] | None = None
    peak_lr: Callable[[OptimizerPlan], float] | None = None  # its learning rate at the schedule's peak
    # the header's "(lr 0.02, ...)", given the device type, the parameters it trains and the step's placement
    describe: Callable[[OptimizerPlan, str, list[torch.Tensor], StepPlacement], str] | None = None
    place: Callable[[torch.optim.Optimizer, StepPlacement], None] | None = None  # told where its step runs (prepare)
    refused_under: Mapping[str, Refusal] = field(default_factory=dict)  # support-table column -> why not
    # support-table column -> what running there costs beyond the engine's own work, in a few words (the cell's note)
    costs_under: Mapping[str, str] = field(default_factory=dict)
    lora_refusal: str | None = None  # why it cannot train LoRA adapters (None: it can)


@dataclass(frozen=True)
class OptimizerPlan:
    """The run's optimizers, resolved from `--optimizer` and the job: what trains with what, at which peak LR."""

    spec: OptimizerSpec  # AdamW's for every parameter, or the optimizer of the claimed ones (AdamW on the rest)
    job: str  # what trains: a key of configs.schema.DEFAULT_LRS ("LoRA", "full fine-tuning", ...)
    lr: float  # AdamW's peak learning rate: --lr, else the job's default
    lr_is_default: bool  # no --lr was given
    muon_lr: float  # Muon's peak learning rate (--muon_lr)
    weight_decay: float
    betas: tuple[float, float]
    muon_momentum: float
    muon_weight_decay: float

    @property
    def kind(self) -> str:
        """The optimizer --optimizer resolved to ("adamw", "muon", ...)."""
        return self.spec.name

    @property
    def names(self) -> tuple[str, ...]:
        """The optimizers `build_optimizer` returns, in order: ("adamw",) or ("adamw", the claiming one)."""
        return ("adamw",) if self.spec.claims is None else ("adamw", self.spec.name)

    def lrs_at(self, factor: float) -> list[float]:
        """Each optimizer's learning rate when the schedule is at `factor` of the peak (one per optimizer)."""
        return [self.lr * factor] + ([self.spec.peak_lr(self) * factor] if self.spec.claims is not None else [])
