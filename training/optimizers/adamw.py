"""AdamW: the base optimizer. It trains every parameter that no other optimizer claims.

Only matrices and embeddings (>= 2-D) decay, not biases or LayerNorm gains. On CUDA the fused kernel does the whole
update in a few launches, not one per tensor."""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

from training.optimizers.spec import BASE_STATE_BYTES, EVERY_PARAMETER, OptimizerPlan, OptimizerSpec, StepPlacement

if TYPE_CHECKING:
    import torch


def build(params: list[torch.nn.Parameter], plan: OptimizerPlan, device_type: str) -> torch.optim.Optimizer:
    import torch  # not above: train.py reads the optimizers' flags before torch loads

    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": plan.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    return torch.optim.AdamW(groups, lr=plan.lr, betas=plan.betas, **({"fused": True} if fused else {}))


def describe(plan: OptimizerPlan, device_type: str, params: list, placement: StepPlacement) -> str:
    return f"lr {plan.lr:g}" + (f", the default for {plan.job}" if plan.lr_is_default else "")


SPEC = OptimizerSpec(name="adamw", display="AdamW", claims=EVERY_PARAMETER, state_bytes=BASE_STATE_BYTES, build=build,
                     peak_lr=lambda plan: plan.lr, describe=describe)
