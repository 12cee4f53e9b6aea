"""What an optimizer declares to take part in a run (`OptimizerSpec`), and `--optimizer` resolved for one run
(`OptimizerPlan`).

An optimizer that claims every parameter trains alone. One that claims a part (Muon: the blocks' matrices) trains
beside AdamW, which takes the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

from common.engine_names import Refusal

if TYPE_CHECKING:  # annotations only: train.py's command line reads the specs before torch loads
    import torch

# What an optimizer may claim: every trainable parameter (it trains alone), or the blocks' 2-D weights
# (`transformer.h.*`, the planner's `ParamCounts.block_matrices`) with AdamW on the rest.
EVERY_PARAMETER = "every parameter"
BLOCK_MATRICES = "the blocks' 2-D weights"
BASE_STATE_BYTES = 8  # AdamW's two fp32 moments
# In an optimizer that stands for several (`OptimizerSpec.zero_build`), a param group's key: the index in
# `OptimizerPlan.names` of the optimizer whose LR the group takes (`training.step.set_learning_rates`).
LR_OF = "lr_of"


def claimed_names(model: torch.nn.Module, claims: str) -> list[str]:
    """The names of the trainable parameters `claims` means in `model`, a tied weight once. A parameter ZeRO-3 has
    partitioned is empty; its shape is read from `ds_shape`."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if claims == EVERY_PARAMETER:
        return [name for name, _ in trainable]
    if claims != BLOCK_MATRICES:
        raise ValueError(f"unknown parameter set {claims!r}")
    return [name for name, p in trainable
            if len(getattr(p, "ds_shape", p.shape)) == 2 and name.startswith("transformer.h.")]


@dataclass(frozen=True)
class StepPlacement:
    """Where an optimizer's step runs: the engine and compile setting (`OptimizerSpec.place`). Read from the prepared
    model by `training.distributed.prepare.step_placement`; the default is one process, eager."""

    # The ranks that hold the same averaged gradients of the same whole parameters (DDP's group, a pipeline stage's
    # replicas): an optimizer may split work over them. None on one process, or where FSDP2 or TP shard parameters.
    group: object = None
    ranks: int = 1  # the group's size
    compile_backend: str | None = None  # torch.compile's backend where the run compiles its model; None: eager
    zero_stage: int = 0  # DeepSpeed's ZeRO stage, where the step runs inside its engine


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer, as the run, the planner, the checkpoints and the support table see it."""

    name: str  # --optimizer's value; checkpoints record it
    display: str  # how the run's header names it
    claims: str  # EVERY_PARAMETER (it trains alone) or BLOCK_MATRICES (beside AdamW)
    state_bytes: int  # optimizer state per parameter it trains, in bytes
    # Its own flags (`--muon_lr`, ...): a dataclass of `common.resume_rules.flag` fields that checks its values.
    # Registering adds them to train.py's flags; `OptimizerPlan.flags` carries the parsed values.
    flags: type | None = None
    build: Callable[[list[torch.nn.Parameter], OptimizerPlan, str], torch.optim.Optimizer] | None = None
    peak_lr: Callable[[OptimizerPlan], float] | None = None  # its learning rate at the schedule's peak
    # the header's "(lr 0.02, ...)", from the device type, the parameters it trains and the step's placement
    describe: Callable[[OptimizerPlan, str, list[torch.Tensor], StepPlacement], str] | None = None
    place: Callable[[torch.optim.Optimizer, StepPlacement], None] | None = None  # told where its step runs
    # ZeRO takes one client optimizer: this builds one over (claimed, rest, plan, device type) that stands for AdamW
    # and this one, each param group naming which (`LR_OF`). None: built as elsewhere, or refused (`refused_under`).
    zero_build: Callable[[list[torch.nn.Parameter], list[torch.nn.Parameter], OptimizerPlan, str],
                         torch.optim.Optimizer] | None = None
    refused_under: Mapping[str, Refusal] = field(default_factory=dict)  # support-table column -> why not
    # support-table column -> its cost there beyond the engine's own work, in a few words (the cell's note)
    costs_under: Mapping[str, str] = field(default_factory=dict)
    lora_refusal: str | None = None  # why it cannot train LoRA adapters (None: it can)
    # It needs whole matrices (Muon): under FSDP2 and TP each is gathered, which the planner charges.
    whole_matrices: bool = False

    @property
    def alone(self) -> bool:
        """It trains every parameter, without AdamW beside it."""
        return self.claims == EVERY_PARAMETER

    def state_bytes_of(self, total: int, block_matrices: int) -> int:
        """The optimizers' state in bytes for `total` parameters, `block_matrices` of them in the blocks' matrices."""
        claimed = total if self.alone else block_matrices
        return self.state_bytes * claimed + BASE_STATE_BYTES * (total - claimed)


@dataclass(frozen=True)
class OptimizerPlan:
    """The run's optimizers, resolved from `--optimizer` and the job: what trains with what, at which peak LR."""

    spec: OptimizerSpec  # the optimizer alone, or the claiming one beside AdamW
    job: str  # what trains: a key of configs.schema.DEFAULT_LRS ("LoRA", "full fine-tuning", ...)
    lr: float  # AdamW's peak learning rate: --lr, else the job's default
    lr_is_default: bool  # no --lr was given
    weight_decay: float  # AdamW's
    betas: tuple[float, float]  # AdamW's
    flags: Any = None  # the claiming optimizer's own flags, parsed (`OptimizerSpec.flags`); None for AdamW alone

    @property
    def kind(self) -> str:
        """The optimizer --optimizer resolved to ("adamw", "muon", ...)."""
        return self.spec.name

    @property
    def names(self) -> tuple[str, ...]:
        """The optimizers `build_optimizer` returns, in order: (the one alone,) or ("adamw", the claiming one)."""
        return (self.spec.name,) if self.spec.alone else ("adamw", self.spec.name)

    def with_recorded(self, values: Mapping[str, Any]) -> OptimizerPlan:
        """This plan with the peak LRs a run's config.yaml `values` record, for a resume to compare."""
        flags = self.flags
        if flags is not None:
            flags = replace(flags, **{f.name: values[f.name] for f in fields(flags) if f.name in values})
        return replace(self, lr=values["lr"], flags=flags)

    def lrs_at(self, factor: float) -> list[float]:
        """Each optimizer's LR when the schedule is at `factor` of the peak."""
        peaks = [self.spec.peak_lr(self)] if self.spec.alone else [self.lr, self.spec.peak_lr(self)]
        return [peak * factor for peak in peaks]
