"""The optimizers a run trains with, built from the model's parameters and the run's config.

AdamW is the base: `--optimizer adamw` is one AdamW over every parameter. Another optimizer (`--optimizer muon`)
claims a set of parameters (Muon: the blocks' 2-D weights) and AdamW trains the rest (embeddings, the tied output
layer, biases, LayerNorms). Each optimizer is one module of `training.optimizers`, registered in
`training.optimizers.registry`; this module only resolves and assembles them.

`--optimizer auto` is resolved once, into an `OptimizerPlan`: Muon to train from scratch (tuned and measured
here: docs/benchmarks.md), AdamW to fine-tune weights that AdamW trained and for LoRA adapters (low-rank
factors, not hidden matrices).

Invariants: every trainable parameter is in exactly one optimizer (a tied weight once); the list's first
optimizer is always the AdamW (accelerate saves it as `optimizer.bin`, a second one as `optimizer_1.bin`);
`plan.names` names them in that order (checkpoints record it); the learning rates of step s are
`plan.lrs_at(schedule.factor(s))`, one per optimizer, in that order.
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
    """`--optimizer` resolved for what trains (`auto`: Muon to train from scratch, AdamW to fine-tune or for LoRA),
    and AdamW's learning rate: `--lr`, else the default of the job (configs.schema.DEFAULT_LRS). `flags`: the
    registered optimizers' own flags as parsed (`TrainConfig.added`; default: their defaults). An optimizer that is
    not registered, or one that cannot train LoRA's adapters under --lora_rank, is refused in one line."""
    spec = optimizer_spec(cfg.optimizer if cfg.optimizer != "auto" else "muon" if model.from_scratch else "adamw")
    if model.lora_rank and spec.lora_refusal:
        raise UserError(f"--lora_rank trains its adapters with AdamW only "
                        f"({spec.lora_refusal.format(rank=model.lora_rank)}); drop --optimizer {spec.name} or "
                        "--lora_rank")
    if model.from_scratch:
        job = f"from scratch with {spec.display}"
        # An optimizer without a measured default of its own: AdamW's LR beside a matrix optimizer (Muon's).
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
    """[the optimizer alone] or [AdamW, the claiming optimizer] (`plan.names`). Where the engine takes one client
    optimizer and hands it flat partitions (`one_client`: DeepSpeed's ZeRO), a claiming optimizer's `zero_build`:
    [one optimizer standing for both]."""
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
        return f"{head}: {plan.spec.display} ({about}) on all {total / 1e6:.2f}M trainable params"
    claimed = sum(full_numel(named[name]) for name in names)
    if any(isinstance(named[name], DTensor) for name in names):  # FSDP2's shards, tensor parallelism's pieces
        about += ", each matrix gathered whole on every rank"
    base = adamw.describe(plan, device_type, [], placement)
    return (f"{head}: {plan.spec.display} ({about}) on {plan.spec.claims} ({claimed / 1e6:.2f}M params), "
            f"AdamW ({base}) on embeddings/output layer, biases, LayerNorms ({(total - claimed) / 1e6:.2f}M)")


def full_numel(parameter) -> int:
    """A parameter's number of elements, also under ZeRO-3, which leaves a partitioned parameter empty on every
    rank and keeps its size in `ds_numel`."""
    return getattr(parameter, "ds_numel", parameter.numel())


def release_optimizer_state(optimizers: list[torch.optim.Optimizer]) -> None:
    """Free the optimizers' state (AdamW's two tensors per parameter: twice the weights) once the run's last
    checkpoint holds it: the export that follows then peaks under the training step (docs/benchmarks.md)."""
    for optimizer in optimizers:
        optimizer.state.clear()
