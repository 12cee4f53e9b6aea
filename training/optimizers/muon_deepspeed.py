"""Muon under DeepSpeed's ZeRO: DeepSpeed's `MuonWithAuxAdam` as the engine's one client optimizer, with the run's
groups, learning rates, momentum and weight decay.

DeepSpeed orthogonalises each whole matrix while it fills the gradient partitions. Its update is torch's Muon's, with
torch's AdamW on the rest; only its clipping differs, hence `--grad_clip 0` (`training.optimizers.muon`). The
gradient norm it reports, which the run logs, mixes Muon's updates with AdamW's gradients: far above the raw norm.

Newton-Schulz runs DeepSpeed's default `ns_method`, "gram": the same iteration on the Gram matrix, in fewer FLOPs. It
computes in float16 on GPUs and in float32 elsewhere. It ends nearer one process than "standard" does
(docs/benchmarks.md, "Muon under ZeRO").

Each param group names the optimizer whose LR it takes (`spec.LR_OF`). The checkpoint holds this one optimizer. It
resumes bit for bit under the same ZeRO stage on as many processes, and moves to no other engine.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from training.optimizers.spec import LR_OF, OptimizerPlan

if TYPE_CHECKING:
    import torch

NS_METHOD = "gram"  # see the module's docstring


def build(claimed: list[torch.nn.Parameter], rest: list[torch.nn.Parameter], plan: OptimizerPlan,
          device_type: str) -> torch.optim.Optimizer:
    """DeepSpeed's MuonWithAuxAdam over every parameter: Muon on `claimed`, torch's AdamW on `rest` in AdamW's usual
    groups (`training.optimizers.adamw`). ZeRO reads the `use_muon` tag from each parameter itself."""
    import torch
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    for p in claimed:
        p.use_muon = True
    for p in rest:
        p.use_muon = False
    own, muon, adamw = plan.flags, plan.names.index(plan.spec.name), plan.names.index("adamw")
    adam = {"use_muon": False, "betas": plan.betas, "eps": 1e-8, "lr": plan.lr, LR_OF: adamw}
    groups = [
        {"params": list(claimed), "use_muon": True, "lr": own.muon_lr, "momentum": own.muon_momentum,
         "weight_decay": own.muon_weight_decay, "ns_method": NS_METHOD, LR_OF: muon},
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": plan.weight_decay, **adam},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0, **adam},
    ]
    return MuonWithAuxAdam(groups, adam_optimizer=torch.optim.AdamW)


def describe(plan: OptimizerPlan, stage: int) -> str:
    """The header's words for it, e.g. "DeepSpeed's MuonWithAuxAdam under ZeRO-2: lr 0.02, Newton-Schulz ("gram") in
    float16, ..."."""
    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype

    dtype = str(ns_compute_dtype(NS_METHOD)).removeprefix("torch.")
    return (f"DeepSpeed's MuonWithAuxAdam under ZeRO-{stage}: lr {plan.flags.muon_lr:g}, Newton-Schulz "
            f"(\"{NS_METHOD}\") in {dtype}, each matrix whole as ZeRO fills its gradient partition; the grad norm "
            "logged is DeepSpeed's, of these updates and AdamW's gradients")
