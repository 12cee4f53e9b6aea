"""Muon on the blocks' 2-D weights (attention and MLP projections), AdamW on the rest: what a run declares of it.

Muon orthogonalises a matrix's update, which suits hidden layers only, and torch's Muon takes 2-D parameters only;
embeddings, the tied output layer, biases and LayerNorms stay with AdamW. The optimizer itself (torch.optim.Muon with
its Newton-Schulz in the dtype the device multiplies fast, stacked by shape, split over the data-parallel ranks, on
sharded matrices) is `training.optimizers.muon_optimizer.Muon`, imported when it is built or described: this module,
its flags with it, stays free of torch, so that train.py's command line answers before torch is imported.

Under DeepSpeed's ZeRO, which hands a client optimizer flat partitions in which no matrix is whole, it runs as
DeepSpeed's own Muon (`MuonWithAuxAdam`, orthogonalising whole matrices while it fills the gradient partitions:
`zero_build`, `training.optimizers.muon_deepspeed`) with clipping off (`--grad_clip 0`) only: that Muon clips the
orthogonalised update by the global norm of updates and gradients together, not the raw gradient as torch's Muon
after `clip_grad_norm_` does, measured by `benchmarks/muon_under_zero.py` (docs/benchmarks.md) 18% of the weights'
move apart from one process after 10 steps at --grad_clip 1 under ZeRO-1, 2 and 3 alike, 6e-6 (float rounding)
with clipping off. So its ZeRO cells of the support table are refusals lifted by `--grad_clip 0`
(`SPEC.refused_under`, `Refusal.unless`). LoRA's low-rank factors are not hidden matrices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from common.engine_names import DEEPSPEED, FSDP_COLUMN, TP_COLUMN, ZERO_COLUMNS, Refusal, engine_name
from common.errors import UserError
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
    muon_momentum: float = flag(0.95, "Muon's momentum (Nesterov)", RESTORED)
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
    """The run's data-parallel group splits the orthogonalisations (`Muon.split_group`); its compile backend compiles
    the stacked iteration (`Muon.compile_backend`)."""
    optimizer.split_group = placement.group if placement.ranks > 1 else None
    optimizer.compile_backend = placement.compile_backend


def describe(plan: OptimizerPlan, device_type: str, matrices: list[torch.Tensor], placement: StepPlacement) -> str:
    """"lr 0.02, Newton-Schulz in bfloat16, stacked by shape (4 groups), compiled, split over 8 ranks": how the step
    orthogonalises (`place` and `Muon.step`). Sharded matrices (DTensors) are one at a time, as the header says
    (`training.optimizers.plan.describe_optimizers`); under ZeRO, DeepSpeed's Muon (`zero_build`) says its own."""
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
    """Under ZeRO, which takes one client optimizer: DeepSpeed's Muon with AdamW beside it, in one
    (`training.optimizers.muon_deepspeed`)."""
    from training.optimizers import muon_deepspeed

    return muon_deepspeed.build(claimed, rest, plan, device_type)


# Where each matrix is sharded or split (`Muon.step`): one all-gather of it a step, Newton-Schulz on every rank.
_GATHERED = "each matrix all-gathered a step"
# Measured (benchmarks/muon_under_zero.py, docs/benchmarks.md; tests/test_muon.py holds DeepSpeed to it).
_ZERO_WHY = ("ZeRO hands an optimizer flat partitions, where no matrix is whole, and the Muon DeepSpeed runs there "
             "clips the orthogonalised update, not the gradient: 18% apart from torch's Muon after 10 steps at "
             "--grad_clip 1, float rounding with clipping off")
SPEC = OptimizerSpec(
    name="muon", display="Muon", claims=BLOCK_MATRICES, state_bytes=4,  # one fp32 momentum buffer per matrix
    flags=MuonFlags, build=build, peak_lr=lambda plan: plan.flags.muon_lr, describe=describe, place=place,
    zero_build=zero_build,
    refused_under={ZERO_COLUMNS[s]: Refusal(_ZERO_WHY, f"pass --grad_clip 0 (clipping off: DeepSpeed's Muon is then "
                                                       f"torch's), or use --optimizer adamw with "
                                                       f"{engine_name(DEEPSPEED, s)}, or Muon with a DDP or FSDP2 "
                                                       "launch config", unless="--grad_clip 0")
                   for s in (1, 2, 3)},
    costs_under={**{column: _GATHERED for column in (FSDP_COLUMN, TP_COLUMN)},
                 **{ZERO_COLUMNS[s]: "DeepSpeed's own Muon" for s in (1, 2, 3)}},
    lora_refusal="Muon orthogonalises whole hidden matrices, not rank-{rank} factors", whole_matrices=True,
)
