"""Muon on the blocks' 2-D weights (attention and MLP projections), AdamW on the rest: the run's declaration of it.

Muon orthogonalises a matrix's update. That suits hidden layers only, and torch's Muon takes 2-D parameters only, so
embeddings, the tied output layer, biases and LayerNorms stay with AdamW. LoRA's low-rank factors are not hidden
matrices either.

The optimizer itself is `training.optimizers.muon_optimizer.Muon`, imported only to build or describe it. This module
and its flags stay free of torch, so train.py's command line answers before torch loads.

ZeRO hands a client optimizer flat partitions in which no matrix is whole. There Muon runs as DeepSpeed's own
(`zero_build`, `training.optimizers.muon_deepspeed`), and only with clipping off. DeepSpeed's Muon clips the
orthogonalised update, not the raw gradient: at `--grad_clip 1` it ends 18% apart from torch's Muon, at
`--grad_clip 0` the two agree to float rounding (docs/benchmarks.md, "Muon under ZeRO"). So Muon's ZeRO cells of
the support table are refusals that `--grad_clip 0` lifts (`SPEC.refused_under`, `Refusal.unless`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from common.engine_names import DEEPSPEED, FSDP_COLUMN, ZERO_COLUMNS, Refusal
from common.errors import UserError
from common.parallelism import TENSOR, Parallelism
from common.resume_rules import RESTORED, SCHEDULE, flag
from training.optimizers.spec import BLOCK_MATRICES, OptimizerPlan, OptimizerSpec, StepPlacement

if TYPE_CHECKING:
    import torch

    from training.optimizers.muon_optimizer import Muon


@dataclass
class MuonFlags:
    """Muon's own flags, beside AdamW's (`--lr`, `--weight_decay`, `--beta1/2`)."""

    _argument_group_name = "Muon (--optimizer muon)"

    muon_lr: float = flag(0.02, "Muon's peak learning rate; same warmup and decay as --lr", SCHEDULE)
    muon_momentum: float = flag(0.9, "Muon's momentum (Nesterov)", RESTORED)
    muon_weight_decay: float = flag(0.0, "Muon's decoupled weight decay (each step w -= lr x wd x w)", RESTORED)

    def __post_init__(self) -> None:
        if not 0 < self.muon_lr < math.inf:
            raise UserError(f"--muon_lr must be positive, got {self.muon_lr}; use e.g. 0.02")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise UserError(f"--muon_momentum must be in [0, 1), got {self.muon_momentum}; use e.g. 0.95")
        if not 0 <= self.muon_weight_decay < math.inf:
            raise UserError(f"--muon_weight_decay must be 0 or more, got {self.muon_weight_decay}; use e.g. 0 or 0.01")


# --muon_lr as shipped: measured from scratch (docs/benchmarks.md), said as such where a run fine-tunes with it
DEFAULT_MUON_LR = next(f.default for f in fields(MuonFlags) if f.name == "muon_lr")


def build(params: list[torch.nn.Parameter], plan: OptimizerPlan, device_type: str) -> torch.optim.Optimizer:
    from training.optimizers.muon_optimizer import Muon, newton_schulz_dtype

    own = plan.flags
    return Muon(params, lr=own.muon_lr, momentum=own.muon_momentum, weight_decay=own.muon_weight_decay,
                ns_dtype=newton_schulz_dtype(device_type))


def place(optimizer: Muon, placement: StepPlacement) -> None:
    """Tell the step which ranks split the orthogonalisations (`Muon.split_group`) and how to compile the stacked
    iteration (`Muon.compile_backend`)."""
    optimizer.split_group = placement.group if placement.ranks > 1 else None
    optimizer.compile_backend = placement.compile_backend


def describe(plan: OptimizerPlan, device_type: str, matrices: list[torch.Tensor], placement: StepPlacement) -> str:
    """How the step orthogonalises, e.g. "lr 0.02, Newton-Schulz in bfloat16, stacked by shape (4 groups), compiled,
    split over 8 ranks". Sharded matrices (DTensors) go one at a time, which
    `training.optimizers.plan.describe_optimizers` adds. Under ZeRO, DeepSpeed's Muon describes itself."""
    if placement.zero_stage:
        from training.optimizers import muon_deepspeed

        return muon_deepspeed.describe(plan, placement.zero_stage)
    from torch.distributed.tensor import DTensor

    from training.optimizers.muon_optimizer import Muon, newton_schulz_dtype

    ns_dtype = str(newton_schulz_dtype(device_type)).removeprefix("torch.")
    about = f"lr {plan.flags.muon_lr:g}"
    if not plan.job.startswith("from scratch") and plan.flags.muon_lr == DEFAULT_MUON_LR:
        about += f", its from-scratch default: none is measured for {plan.job}; --muon_lr sets it"
    about += f", Newton-Schulz in {ns_dtype}"
    if not Muon.stacked or any(isinstance(m, DTensor) for m in matrices):
        return about
    about += f", stacked by shape ({len({tuple(m.shape) for m in matrices})} groups)"
    about += ", compiled" if placement.compile_backend else ""
    return about + (f", split over {placement.ranks} ranks" if placement.ranks > 1 else "")


def zero_build(claimed: list[torch.nn.Parameter], rest: list[torch.nn.Parameter], plan: OptimizerPlan,
               device_type: str) -> torch.optim.Optimizer:
    """Under ZeRO, which takes one client optimizer: DeepSpeed's Muon with AdamW inside it
    (`training.optimizers.muon_deepspeed`)."""
    from training.optimizers import muon_deepspeed

    return muon_deepspeed.build(claimed, rest, plan, device_type)


# Under FSDP2 and TP each matrix is gathered whole once a step for its Newton-Schulz (`Muon.step`).
_GATHERED = "each matrix all-gathered a step"
# Measured: docs/benchmarks.md, "Muon under ZeRO". tests/test_muon.py fails if DeepSpeed changes.
_ZERO_WHY = ("ZeRO hands an optimizer flat partitions, where no matrix is whole, and the Muon DeepSpeed runs there "
             "clips the orthogonalised update, not the gradient: 18% apart from torch's Muon after 10 steps at "
             "--grad_clip 1, float rounding with clipping off")
SPEC = OptimizerSpec(
    name="muon", display="Muon", claims=BLOCK_MATRICES, state_bytes=4,  # one fp32 momentum buffer per matrix
    flags=MuonFlags, build=build, peak_lr=lambda plan: plan.flags.muon_lr, describe=describe, place=place,
    zero_build=zero_build,
    refused_under={ZERO_COLUMNS[s]: Refusal(_ZERO_WHY, f"pass --grad_clip 0 (clipping off: DeepSpeed's Muon is then "
                                                       f"torch's), or use --optimizer adamw with "
                                                       f"{Parallelism(DEEPSPEED, s).name}, or Muon with a DDP or FSDP2 "
                                                       "launch config", unless="--grad_clip 0")
                   for s in (1, 2, 3)},
    costs_under={**{column: _GATHERED for column in (FSDP_COLUMN, TENSOR.column)},
                 **{ZERO_COLUMNS[s]: "DeepSpeed's own Muon" for s in (1, 2, 3)}},
    lora_refusal="Muon orthogonalises whole hidden matrices, not rank-{rank} factors", whole_matrices=True,
)
