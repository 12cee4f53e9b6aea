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
    """[model, *optimizers] as the run trains them (see the module docstring); `plan`: what `optimizers` were built
    from (`training.optimizers.plan.build_optimizer`). The claiming optimizer (Muon) is then told where its step runs
    (`step_placement`: the ranks that average the gradients, the compile backend)."""
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
    """Where the optimizers' step runs in this run, read from `model` as `prepare` returns it: the process group DDP
    averages the gradients over, or a pipeline stage's replicas (`PipelinedGPT`, which averages them itself), and
    torch.compile's backend where the run compiles (accelerate's dynamo backend). FSDP2 (tensor parallelism
    included), ZeRO and one process: no group; ZeRO: its stage (the client optimizer steps inside its engine). The
    run's header says what it reads (`training.metrics`)."""
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
    """The optimizers `prepare` kept out of accelerate under FSDP2, with their index (accelerate's file numbering)."""
    return [(i, opt) for i, opt in enumerate(optimizers) if not isinstance(opt, AcceleratedOptimizer)]
