"""The optimizer a run trains with, built from the model's parameters and the run's config."""
from __future__ import annotations

import inspect

import torch

from configs import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device_type: str) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices and embeddings (>= 2-D) only, not on biases or LayerNorm gains."""
    params = [p for p in model.parameters() if p.requires_grad]  # a tied weight appears once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # The fused CUDA kernel does the whole update in a few launches instead of one per tensor.
    fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **({"fused": True} if fused else {}))
