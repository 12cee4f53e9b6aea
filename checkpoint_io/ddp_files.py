"""A DDP run's checkpoint files, which a pipeline writes too.

`model.safetensors` holds the whole model by name. `optimizer.bin` (and `optimizer_1.bin`) is torch's optimizer
state dict: each parameter's state under its number, as one process's optimizers number the whole model (`Groups`,
which the caller computes from the model). accelerate writes these files for DDP and one process. A pipeline's
stages gather their parts and write the same files, so each of these runs resumes the others.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from checkpoint_io.whole_state import WholeState, strip_wrapper_prefixes
from common.errors import UserError
from common.run_dir import MODEL_WEIGHTS, optimizer_file

Groups = list[list[list[str]]]  # for each optimizer, its param groups: the names of their parameters, in order


def read(folder: Path, groups: Groups) -> WholeState:
    """The weights, and each optimizer's state and settings as `groups` numbers them (none without `groups`)."""
    optimizers = [_read_optimizer(folder, index, optimizer_groups) for index, optimizer_groups in enumerate(groups)]
    return WholeState(strip_wrapper_prefixes(_read_weights(folder)), [states for states, _ in optimizers],
                      [settings for _, settings in optimizers] if groups else None)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = folder / MODEL_WEIGHTS
    if not file.is_file():
        raise UserError(f"no {MODEL_WEIGHTS} in {folder}; provide the weights as safetensors")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as err:
        raise UserError(f"the weights in {folder} are damaged ({err.__class__.__name__}: {err}); restore them or use "
                        "another checkpoint") from None


def _read_optimizer(folder: Path, index: int, groups: list[list[str]]) -> tuple[dict[str, dict], list[dict]]:
    """Optimizer `index`'s state by parameter name, and its param groups' saved hyper-parameters. `groups` numbers
    its parameters (one entry of `Groups`)."""
    path = folder / optimizer_file(index)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    flat = [name for group in groups for name in group]
    if len(saved["param_groups"]) != len(groups):
        raise UserError(f"{path} holds {len(saved['param_groups'])} param groups, this run's optimizer has "
                        f"{len(groups)}; resume it with the settings it was saved with")
    settings = [{k: v for k, v in group.items() if k != "params"} for group in saved["param_groups"]]
    return {flat[i]: state for i, state in saved["state"].items()}, settings


def write(folder: Path, weights: dict[str, torch.Tensor], states: list[dict[str, dict[str, Any]]], groups: Groups,
          settings: list[list[dict[str, Any]]]) -> None:
    """Write the whole model: `weights` by name, and each optimizer's state by name, numbered by `groups`.
    `settings` holds each param group's hyper-parameters."""
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in weights.items()}, str(folder / MODEL_WEIGHTS),
              metadata={"format": "pt"})
    for index, (by_name, optimizer_groups) in enumerate(zip(states, groups, strict=True)):
        flat = [name for group in optimizer_groups for name in group]
        starts = [sum(len(g) for g in optimizer_groups[:i]) for i in range(len(optimizer_groups))]
        param_groups = [{**h, "params": list(range(start, start + len(g)))}
                        for h, start, g in zip(settings[index], starts, optimizer_groups, strict=True)]
        state = {i: by_name[name] for i, name in enumerate(flat) if name in by_name}
        torch.save({"state": state, "param_groups": param_groups}, folder / optimizer_file(index))
