"""The model and its optimizers handed to accelerate (`accelerator.prepare`), except what accelerate cannot hold.

- A pipeline's stage and its optimizers stay out (`training.distributed.pipeline`): accelerate's DDP would span stages
that hold
  different parameters.
- Under FSDP2 (tensor parallelism included) only the first optimizer (AdamW) goes in: accelerate's `save_state` and
  `load_state` pair its i-th optimizer with its i-th model, and a run has one model. The second (Muon on the
  blocks' matrices) is built on the sharded parameters of the prepared model, and `training.checkpoints.checkpoint`
  saves and
  loads its shards with accelerate's own FSDP functions, as `optimizer_1/` beside `optimizer_0/`.
"""
from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from model.unwrap import unwrapped
from training.distributed.pipeline import PipelinedGPT
from training.optimizers.spec import OptimizerPlan, claimed_names


def prepare(accelerator: Accelerator, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
            plan: OptimizerPlan) -> list:
    """[model, *optimizers] as the run trains them (see the module docstring); `plan`: what `optimizers` were built
    from (`training.optimizers.plan.build_optimizer`)."""
    if isinstance(model, PipelinedGPT):
        model.optimizers, model.plan = list(optimizers), plan
        return [model, *optimizers]
    if accelerator.distributed_type != DistributedType.FSDP or len(optimizers) == 1:
        return accelerator.prepare(model, *optimizers)
    model, first = accelerator.prepare(model, optimizers[0])
    network = unwrapped(model)
    named = dict(network.named_parameters())
    device_type = next(network.parameters()).device.type
    claimed = [named[name] for name in sorted(claimed_names(network, plan.spec.claims))]
    return [model, first, plan.spec.build(claimed, plan, device_type)]


def outside_accelerate(optimizers: list[torch.optim.Optimizer]) -> list[tuple[int, torch.optim.Optimizer]]:
    """The optimizers `prepare` kept out of accelerate under FSDP2, with their index (accelerate's file numbering)."""
    return [(i, opt) for i, opt in enumerate(optimizers) if not isinstance(opt, AcceleratedOptimizer)]
