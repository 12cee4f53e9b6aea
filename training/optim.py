"""The optimizers a run trains with, built from the model's parameters and the run's config.

`--optimizer adamw`: one AdamW over every parameter. `--optimizer muon`: torch.optim.Muon on the 2-D weight
matrices inside the transformer blocks (attention and MLP projections), AdamW on everything else (token and
position embeddings, the output layer tied to the token embedding, biases, LayerNorms): Muon orthogonalises a
matrix's update, which suits hidden layers only, and torch's Muon takes 2-D parameters only.

Invariants: every trainable parameter is in exactly one optimizer (a tied weight once); the list's first
optimizer is always the AdamW (accelerate saves it as `optimizer.bin`, a second one as `optimizer_1.bin`); the
learning rates of step s are `scheduled_lrs(cfg, learning_rate(cfg, s))`, one per optimizer, in that order.
"""
from __future__ import annotations

import inspect

import torch

from common.errors import UserError
from configs import TrainConfig


def muon_parameter_names(model: torch.nn.Module) -> list[str]:
    """The parameters Muon trains: the 2-D weights of the transformer blocks (`transformer.h.*`)."""
    return [name for name, p in model.named_parameters()
            if p.requires_grad and p.dim() == 2 and name.startswith("transformer.h.")]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device_type: str) -> list[torch.optim.Optimizer]:
    """[AdamW] or [AdamW, Muon] (`cfg.optimizer`). AdamW decays matrices and embeddings (>= 2-D) only, not biases
    or LayerNorm gains."""
    to_muon = set(muon_parameter_names(model)) if cfg.optimizer == "muon" else set()
    named = dict(model.named_parameters())  # a tied weight appears once, under its first name
    adamw_params = [p for name, p in named.items() if p.requires_grad and name not in to_muon]
    groups = [
        {"params": [p for p in adamw_params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in adamw_params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # The fused CUDA kernel does the whole update in a few launches instead of one per tensor.
    fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **({"fused": True} if fused else {}))
    if not to_muon:
        return [adamw]
    muon = torch.optim.Muon([named[name] for name in sorted(to_muon)], lr=cfg.muon_lr,
                            momentum=cfg.muon_momentum, weight_decay=cfg.muon_weight_decay)
    return [adamw, muon]


def scheduled_lrs(cfg: TrainConfig, lr: float) -> list[float]:
    """The learning rate of each optimizer of `build_optimizer` when the schedule gives AdamW `lr`: Muon follows
    the same warmup and decay, scaled to its own peak `--muon_lr`."""
    return [lr] if cfg.optimizer == "adamw" else [lr, lr * cfg.muon_lr / cfg.lr]


def refuse_unsupported(cfg: TrainConfig, sharded: bool) -> None:
    """Muon orthogonalises whole matrices; FSDP shards them, and torch.optim.Muon on FSDP's sharded (DTensor)
    parameters is not verified here: refuse the combination rather than train something untested."""
    if sharded and cfg.optimizer == "muon":
        raise UserError("--optimizer muon is not supported under FSDP (Muon orthogonalises whole matrices, FSDP "
                        "shards them); use --optimizer adamw with FSDP, or Muon with a DDP launch config")


def describe_optimizers(model: torch.nn.Module, cfg: TrainConfig) -> str:
    """Which optimizer trains which parameters, for the run's header."""
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if cfg.optimizer == "adamw":
        return f"optimizer: AdamW on all {total / 1e6:.2f}M trainable params"
    named = dict(model.named_parameters())
    muon = sum(named[name].numel() for name in muon_parameter_names(model))
    return (f"optimizer: Muon (lr {cfg.muon_lr:g}) on the blocks' 2-D weights ({muon / 1e6:.2f}M params), "
            f"AdamW (lr {cfg.lr:g}) on embeddings/output layer, biases, LayerNorms ({(total - muon) / 1e6:.2f}M)")
