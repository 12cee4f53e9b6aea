"""Muon under DeepSpeed's ZeRO: DeepSpeed's own `MuonWithAuxAdam` as the engine's one client optimizer, with the run's
groups, learning rates, momentum and weight decay (`build`), where `--grad_clip 0` makes it torch's Muon's
optimization (`training.optimizers.muon`, `SPEC.refused_under`).

ZeRO hands a client optimizer flat partitions, in which no matrix is whole, so torch's Muon cannot run there; DeepSpeed
orthogonalises each whole matrix while it fills the gradient partitions (stage_1_and_2.py `get_flat_partition`, ZeRO-3
before its sub-groups' step) and its optimizer then applies the update, with the same momentum, Nesterov blend,
quintic iteration, aspect-ratio scale and decoupled weight decay as torch's Muon, and torch's AdamW on the rest. Its
one difference: the clipping, by the global norm of the orthogonalised updates and the other gradients together.
With clipping off (DeepSpeed's `gradient_clipping` 0) the two agree to float rounding (benchmarks/muon_under_zero.py,
docs/benchmarks.md); the norm DeepSpeed reports, which the run logs as its gradient norm, is still that mixed norm.

Its Newton-Schulz is DeepSpeed's default, `ns_method` "gram": torch's quintic iteration computed on the Gram matrix,
with a restart (the same orthogonalisation in fewer FLOPs on a rectangular matrix), in float16 where DeepSpeed's
accelerator multiplies it (GPUs), float32 elsewhere: a finer rounding than torch's bf16. On a 2-core AMD EPYC with
AVX512-BF16 (ours in bf16) 4 steps of a tiny GPT end 3.7% of a matrix's move apart from one process with it (in fp32
there), 5.1% with its "standard" iteration (the torch-like one, in bf16 on every CPU): docs/benchmarks.md.

Each param group says which of the plan's optimizers it stands for (`spec.LR_OF`: an index into `OptimizerPlan.names`),
so the step sets AdamW's learning rate on AdamW's groups and Muon's on Muon's (`training.step.set_learning_rates`).
DeepSpeed's checkpoint holds this one optimizer (Muon's momentum in its partitions' state), which resumes bit for bit
under the same ZeRO stage on as many processes; it moves to no other engine (`training.checkpoints.moving`). What
DeepSpeed reports as the gradient norm, which the run logs, is the norm of Muon's updates and AdamW's gradients
together: above the raw gradients' (21 against 1.4 on the tiny GPT), and finite where they are.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from training.optimizers.spec import LR_OF, OptimizerPlan

if TYPE_CHECKING:
    import torch

NS_METHOD = "gram"  # see the module's docstring


def build(claimed: list[torch.nn.Parameter], rest: list[torch.nn.Parameter], plan: OptimizerPlan,
          device_type: str) -> torch.optim.Optimizer:
    """DeepSpeed's MuonWithAuxAdam over every parameter: Muon on `claimed` (the blocks' matrices, tagged `use_muon`,
    which ZeRO reads from the parameters themselves), torch's AdamW on `rest` with the run's AdamW groups (decay on
    the >= 2-D tensors only: `training.optimizers.adamw`)."""
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
    """The header's words for it: "DeepSpeed's MuonWithAuxAdam under ZeRO-2: lr 0.02, Newton-Schulz ("gram") in
    float16, each matrix whole as ZeRO fills its gradient partition; the grad norm logged is DeepSpeed's, ..."."""
    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype

    dtype = str(ns_compute_dtype(NS_METHOD)).removeprefix("torch.")
    return (f"DeepSpeed's MuonWithAuxAdam under ZeRO-{stage}: lr {plan.flags.muon_lr:g}, Newton-Schulz "
            f"(\"{NS_METHOD}\") in {dtype}, each matrix whole as ZeRO fills its gradient partition; the grad norm "
            "logged is DeepSpeed's, of these updates and AdamW's gradients")
