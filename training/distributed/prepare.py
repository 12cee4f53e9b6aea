"""The model and its optimizers handed to accelerate (`accelerator.prepare`), except what accelerate cannot hold.

- A pipeline stage and its optimizers stay out: accelerate's DDP would span stages that hold different parameters.
- Under FSDP2 only the first optimizer (AdamW) goes in. accelerate's `save_state` pairs its i-th optimizer with its
  i-th model, and a run has one model. The second (Muon) is built on the prepared model's sharded parameters;
  `training.checkpoints.checkpoint` saves its shards with accelerate's FSDP functions, as `optimizer_1/`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType, DynamoBackend
from torch.nn.parallel import DistributedDataParallel

from model.unwrap import unwrapped
from training.distributed.pipeline import PipelinedGPT
from training.optimizers.spec import OptimizerPlan, StepPlacement, claimed_names


def prepare(accelerator: Accelerator, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
            plan: OptimizerPlan) -> list:
    """[model, *optimizers] as the run trains them, built from `plan`. The claiming optimizer (Muon) is then told
    where its step runs (`step_placement`)."""
    if isinstance(model, PipelinedGPT):
        model.optimizers, model.plan = list(optimizers), plan
        prepared = [model, *optimizers]
    elif accelerator.distributed_type != DistributedType.FSDP or len(optimizers) == 1:
        prepared = list(accelerator.prepare(model, *optimizers))
    else:
        model, first = accelerator.prepare(model, optimizers[0])
        network = unwrapped(model)
        named = dict(network.named_parameters())
        device_type = next(network.parameters()).device.type
        claimed = [named[name] for name in sorted(claimed_names(network, plan.spec.claims))]
        prepared = [model, first, plan.spec.build(claimed, plan, device_type)]
    if len(prepared) > 2 and plan.spec.place is not None:
        optimizer = prepared[2]
        plan.spec.place(getattr(optimizer, "optimizer", optimizer), step_placement(accelerator, prepared[0]))
    return prepared


def step_placement(accelerator: Accelerator, model: torch.nn.Module) -> StepPlacement:
    """Where the optimizers' step runs, read from the prepared `model`. The group is the one DDP averages over, or a
    pipeline stage's replicas; FSDP2, ZeRO and one process have none. Under ZeRO it carries the stage, since the
    client optimizer steps inside the engine. The compile backend is accelerate's dynamo backend, where set."""
    backend = accelerator.state.dynamo_plugin.backend
    compile_backend = None if backend == DynamoBackend.NO else backend.value.lower()
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return StepPlacement(compile_backend=compile_backend,
                             zero_stage=int(accelerator.state.deepspeed_plugin.zero_stage))
    while isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    if isinstance(model, DistributedDataParallel):
        return StepPlacement(model.process_group, dist.get_world_size(model.process_group), compile_backend)
    if isinstance(model, PipelinedGPT) and model.pipeline.replica_group is not None:
        return StepPlacement(model.pipeline.replica_group, model.pipeline.replicas, compile_backend)
    return StepPlacement(compile_backend=compile_backend)


def outside_accelerate(optimizers: list[torch.optim.Optimizer]) -> list[tuple[int, torch.optim.Optimizer]]:
    """The optimizers `prepare` kept out of accelerate under FSDP2, with their index in accelerate's file numbering."""
    return [(i, opt) for i, opt in enumerate(optimizers) if not isinstance(opt, AcceleratedOptimizer)]
