"""What an optimizer declares to take part in a run, and the run's resolved choice of optimizers.

An optimizer module declares an `OptimizerSpec`: the parameters it claims, its own flags, how it is built, its
learning rate, its state (which the memory planner adds up), what the run's header says of it, and the engines it
does not run under (which the support table shows and the refusals read). One that claims every parameter trains
alone (AdamW, by default); one that claims a part (Muon: the blocks' matrices) trains beside AdamW, which takes the
rest. `OptimizerPlan` is `--optimizer` resolved for one run.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

from common.engine_names import Refusal

if TYPE_CHECKING:  # annotations only: the specs are read by train.py's command line before torch is imported
    import torch

# What an optimizer may claim: every trainable parameter (it trains alone), or the 2-D weights inside the
# transformer blocks (`transformer.h.*`: the attention and MLP projections; the planner's
# `ParamCounts.block_matrices`), AdamW training the rest.
EVERY_PARAMETER = "every parameter"
BLOCK_MATRICES = "the blocks' 2-D weights"
BASE_STATE_BYTES = 8  # AdamW's, on what a part-claiming optimizer leaves to it: two fp32 moments
# A param group's key in one optimizer that stands for several of the plan's (`OptimizerSpec.zero_build`): the index,
# in `OptimizerPlan.names`, of the optimizer whose learning rate the group takes (`training.step.set_learning_rates`).
LR_OF = "lr_of"


def claimed_names(model: torch.nn.Module, claims: str) -> list[str]:
    """The names of the trainable parameters `claims` means in `model` (a tied weight once); a parameter ZeRO-3 has
    partitioned (an empty 1-D tensor on every rank) by the shape it keeps in `ds_shape`."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if claims == EVERY_PARAMETER:
        return [name for name, _ in trainable]
    if claims != BLOCK_MATRICES:
        raise ValueError(f"unknown parameter set {claims!r}")
    return [name for name, p in trainable
            if len(getattr(p, "ds_shape", p.shape)) == 2 and name.startswith("transformer.h.")]


@dataclass(frozen=True)
class StepPlacement:
    """What a run's engine and compile setting offer an optimizer's step beyond its parameters (`OptimizerSpec.place`;
    `training.distributed.prepare.step_placement` reads it from the prepared model). The default: one process, eager."""

    # The process group whose ranks hold the same averaged gradients of the same whole parameters when the step runs
    # (DDP: its group; a pipeline stage: its replicas), over which an optimizer may split work and gather the
    # results; None: no such group (one process, or parameters sharded by FSDP2 or tensor parallelism).
    group: object = None
    ranks: int = 1  # the group's size
    compile_backend: str | None = None  # torch.compile's backend where the run compiles its model; None: eager
    zero_stage: int = 0  # DeepSpeed's ZeRO stage where the step runs inside its engine (`OptimizerSpec.zero_build`)


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer, as the run, the planner, the checkpoints and the support table see it."""

    name: str  # --optimizer's value; checkpoints record it (accelerate saves the second optimizer as optimizer_1.bin)
    display: str  # how the run's header names it
    claims: str  # EVERY_PARAMETER (it trains alone) or BLOCK_MATRICES (beside AdamW)
    state_bytes: int  # bytes of optimizer state per parameter it trains (AdamW: 8, two fp32 moments)
    # Its own flags (`--muon_lr`, ...): a dataclass of `common.resume_rules.flag` fields that checks its values, added
    # to train.py's flags when the optimizer is registered; the plan carries the parsed values (`OptimizerPlan.flags`).
    flags: type | None = None
    build: Callable[[list[torch.nn.Parameter], OptimizerPlan, str], torch.optim.Optimizer] | None = None
    peak_lr: Callable[[OptimizerPlan], float] | None = None  # its learning rate at the schedule's peak
    # the header's "(lr 0.02, ...)", given the device type, the parameters it trains and the step's placement
    describe: Callable[[OptimizerPlan, str, list[torch.Tensor], StepPlacement], str] | None = None
    place: Callable[[torch.optim.Optimizer, StepPlacement], None] | None = None  # told where its step runs (prepare)
    # Under DeepSpeed's ZeRO, which takes one client optimizer: one over every parameter, standing for AdamW and this
    # one (each param group names which: `LR_OF`), given (claimed, the rest, plan,
    # device type); None: built as elsewhere (AdamW alone), or refused there (`refused_under`)
    zero_build: Callable[[list[torch.nn.Parameter], list[torch.nn.Parameter], OptimizerPlan, str],
                         torch.optim.Optimizer] | None = None
    refused_under: Mapping[str, Refusal] = field(default_factory=dict)  # support-table column -> why not
    # support-table column -> what running there costs beyond the engine's own work, in a few words (the cell's note)
    costs_under: Mapping[str, str] = field(default_factory=dict)
    lora_refusal: str | None = None  # why it cannot train LoRA adapters (None: it can)
    # It orthogonalises whole matrices (Muon): under FSDP2 and tensor parallelism each is gathered for it, which the
    # planner charges as one more matrix and its working copies.
    whole_matrices: bool = False

    @property
    def alone(self) -> bool:
        """It trains every parameter, without AdamW beside it."""
        return self.claims == EVERY_PARAMETER

    def state_bytes_of(self, total: int, block_matrices: int) -> int:
        """The optimizers' state for a model of `total` parameters with `block_matrices` of them in the blocks'
        matrices: its own on what it claims, AdamW's on the rest."""
        claimed = total if self.alone else block_matrices
        return self.state_bytes * claimed + BASE_STATE_BYTES * (total - claimed)


@dataclass(frozen=True)
class OptimizerPlan:
    """The run's optimizers, resolved from `--optimizer` and the job: what trains with what, at which peak LR."""

    spec: OptimizerSpec  # AdamW's for every parameter, or the optimizer of the claimed ones (AdamW on the rest)
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
        """This plan with the peak learning rates a run's config.yaml `values` record (what a resume compares)."""
        flags = self.flags
        if flags is not None:
            flags = replace(flags, **{f.name: values[f.name] for f in fields(flags) if f.name in values})
        return replace(self, lr=values["lr"], flags=flags)

    def lrs_at(self, factor: float) -> list[float]:
        """Each optimizer's learning rate when the schedule is at `factor` of the peak (one per optimizer)."""
        peaks = [self.spec.peak_lr(self)] if self.spec.alone else [self.lr, self.spec.peak_lr(self)]
        return [peak * factor for peak in peaks]
