"""The run's optimizers: `--optimizer` resolved into an `OptimizerPlan`, then built on the model's parameters.

AdamW alone trains every parameter. Another optimizer (Muon) claims a set of parameters and AdamW trains the rest.
Each optimizer is a module of `training.optimizers`; this module only resolves and assembles them. `--optimizer
auto` means Muon from scratch (measured: docs/benchmarks.md), AdamW to fine-tune and for LoRA adapters.

Invariants:
- every trainable parameter is in exactly one optimizer (a tied weight once);
- the first optimizer is AdamW where there are two (accelerate saves `optimizer.bin`, then `optimizer_1.bin`);
- `plan.names` names them in that order, and checkpoints record it;
- step s's learning rates are `plan.lrs_at(schedule.factor(s))`, one per optimizer, in that order.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.distributed.tensor import DTensor

from common.errors import UserError
from configs import ModelConfig, OptimConfig
from configs.schema import DEFAULT_LRS
from training.optimizers import adamw
from training.optimizers.registry import optimizer_spec
from training.optimizers.spec import OptimizerPlan, StepPlacement, claimed_names

__all__ = ["OptimizerPlan", "build_optimizer", "describe_optimizers", "plan_optimizers", "release_optimizer_state"]


def plan_optimizers(cfg: OptimConfig, model: ModelConfig, flags: Mapping[str, Any] | None = None) -> OptimizerPlan:
    """`--optimizer` resolved for what trains, with AdamW's LR: `--lr`, else the job's default
    (`configs.schema.DEFAULT_LRS`). `flags` holds the optimizers' own flags as parsed (`TrainConfig.added`); absent,
    their defaults. Refuses in one line an unregistered optimizer, or one that cannot train LoRA's adapters."""
    spec = optimizer_spec(cfg.optimizer if cfg.optimizer != "auto" else "muon" if model.from_scratch else "adamw")
    if model.lora_rank and spec.lora_refusal:
        raise UserError(f"--lora_rank trains its adapters with AdamW only "
                        f"({spec.lora_refusal.format(rank=model.lora_rank)}); drop --optimizer {spec.name} or "
                        "--lora_rank")
    if model.from_scratch:
        job = f"from scratch with {spec.display}"
        # An optimizer with no measured default of its own gets AdamW's LR beside Muon.
        default = DEFAULT_LRS.get(job, DEFAULT_LRS["from scratch with Muon"])
    else:
        job = "LoRA" if model.lora_rank else "full fine-tuning"
        default = DEFAULT_LRS[job]
    own = (flags or {}).get(spec.name, spec.flags() if spec.flags else None)
    return OptimizerPlan(spec=spec, job=job, lr=cfg.lr if cfg.lr is not None else default,
                         lr_is_default=cfg.lr is None, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2),
                         flags=own)


def build_optimizer(model: torch.nn.Module, plan: OptimizerPlan, device_type: str,
                    one_client: bool = False) -> list[torch.optim.Optimizer]:
    """The optimizers in `plan.names`'s order: [the one alone] or [AdamW, the claiming one]. Under `one_client`
    (DeepSpeed's ZeRO takes one optimizer), a claiming optimizer's `zero_build` returns one that stands for both."""
    named = dict(model.named_parameters())  # a tied weight appears once, under its first name
    claimed = claimed_names(model, plan.spec.claims)
    rest = [p for name, p in named.items() if p.requires_grad and name not in set(claimed)]
    if one_client and not plan.spec.alone and plan.spec.zero_build is not None:
        return [plan.spec.zero_build([named[name] for name in sorted(claimed)], rest, plan, device_type)]
    if plan.spec.alone:  # in the model's order, as checkpoints number them
        return [plan.spec.build([named[name] for name in claimed], plan, device_type)]
    return [adamw.build(rest, plan, device_type), plan.spec.build([named[name] for name in sorted(claimed)], plan,
                                                                  device_type)]


def describe_optimizers(model: torch.nn.Module, plan: OptimizerPlan, placement: StepPlacement | None = None,
                        stage: str | None = None) -> str:
    """Which optimizer trains which parameters, for the run's header, with what each says of itself on the device
    that holds the model and where its step runs (`placement`; Muon: the dtype it orthogonalises in, how it stacks
    and splits the work). `stage`: the blocks of a pipeline's stage whose parameters `model` holds (its counts are
    that stage's, and the line says so)."""
    total = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    device_type = next(model.parameters()).device.type
    placement = placement or StepPlacement()  # one process, eager
    named = dict(model.named_parameters())
    names = claimed_names(model, plan.spec.claims)
    about = plan.spec.describe(plan, device_type, [named[name] for name in names], placement) if plan.spec.describe \
        else f"lr {plan.spec.peak_lr(plan):g}"
    head = "optimizer" if stage is None else f"optimizer (this stage's, {stage}; each stage steps its own)"
    if plan.spec.alone:
        return f"{head}: {plan.spec.display} ({about}) on all {parameter_count(total)} trainable params"
    claimed = sum(full_numel(named[name]) for name in names)
    if any(isinstance(named[name], DTensor) for name in names):  # FSDP2's shards, tensor parallelism's pieces
        about += ", each matrix gathered whole on every rank"
    base = adamw.describe(plan, device_type, [], placement)
    return (f"{head}: {plan.spec.display} ({about}) on {plan.spec.claims} ({parameter_count(claimed)} params), "
            f"AdamW ({base}) on embeddings/output layer, biases, LayerNorms ({parameter_count(total - claimed)})")


def parameter_count(n: int) -> str:
    """A number of parameters as the header writes it: in millions (`0.17M`), or whole under 100,000 (a LoRA run on a
    small model trains a few thousand: `4,096`, not `0.00M`)."""
    return f"{n / 1e6:.2f}M" if n >= 100_000 else f"{n:,}"


def full_numel(parameter) -> int:
    """A parameter's number of elements. ZeRO-3 leaves a partitioned parameter empty and keeps its size in
    `ds_numel`."""
    return getattr(parameter, "ds_numel", parameter.numel())


def release_optimizer_state(optimizers: list[torch.optim.Optimizer]) -> None:
    """Free the optimizers' state (AdamW's is twice the weights) once the last checkpoint holds it. The export then
    peaks below the training step (docs/benchmarks.md, "The whole run, phase by phase")."""
    for optimizer in optimizers:
        optimizer.state.clear()
