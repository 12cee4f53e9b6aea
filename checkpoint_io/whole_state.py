"""What a checkpoint holds, read whole: `WholeState`, by the model's own parameter names.

Each engine's reader (`ddp_files`, `fsdp_files`, `zero_files`) returns one; `checkpoint_io.reader.read_state` picks
the reader by the files. A launch saves its tensors under the names of the wrappers around the model
(`_orig_mod.` of torch.compile, `module.` of DDP): every reader strips them (`plain_name`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from common.parallelism import Parallelism

WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile's and DDP's wrappers


@dataclass
class WholeState:
    """A checkpoint's state, whole, by the model's parameter names: `weights`, and each optimizer's state per
    parameter (AdamW: exp_avg, exp_avg_sq, step; Muon: momentum_buffer). `settings` holds each optimizer's param
    groups' hyper-parameters where the files keep them (a DDP run's), else None. `parallelism` is the launch whose
    layout the tensors are in: as read, the one that saved them. Under tensor parallelism c_attn's rows are in its
    degree's head-group order (`model.tensor_parallel.natural_order`). A tied pair of weights is one tensor, held
    under one of its names."""

    weights: dict[str, torch.Tensor]
    optimizers: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    settings: list[list[dict[str, Any]]] | None = None
    parallelism: Parallelism = field(default_factory=Parallelism)


def plain_name(name: str) -> str:
    """A wrapped model's parameter name without the wrappers' prefixes: the model's own name."""
    while name.startswith(WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def strip_wrapper_prefixes(state: dict[str, Any]) -> dict[str, Any]:
    """A wrapped model's state dict by the model's own names (`plain_name`)."""
    return {plain_name(k): v for k, v in state.items()}
