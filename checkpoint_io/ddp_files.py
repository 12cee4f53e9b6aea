"""A DDP run's checkpoint files, which a pipeline writes too, and which a move into a pipeline goes through.

`model.safetensors` holds the whole model under our names, without the tied output layer. `optimizer.bin` (and
`optimizer_1.bin`) is torch's optimizer state dict, numbered as one process's optimizers number the whole model
(`whole_groups`). accelerate writes these files for DDP and one process. A pipeline's stages gather their parts and
write the same files, so each of these runs resumes the others.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from common.errors import UserError
from common.run_dir import MODEL_WEIGHTS, optimizer_file
from model import GPT, GPTConfig
from training.distributed.pipeline import PipelinedGPT
from training.optimizers.plan import build_optimizer
from training.optimizers.spec import OptimizerPlan

Groups = list[list[list[str]]]  # for each optimizer, its param groups: the names of their parameters, in order
_GROUPS: dict[tuple[str, str], Groups] = {}


def whole_groups(config: GPTConfig, plan: OptimizerPlan) -> Groups:
    """How one process's optimizers number the whole model's parameters, computed once per model and optimizer on
    the meta device."""
    key = (repr(config), plan.kind)
    if key not in _GROUPS:
        with torch.device("meta"):
            whole = GPT(config)
        names = {id(p): name for name, p in whole.named_parameters()}
        _GROUPS[key] = [[[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
                        for optimizer in build_optimizer(whole, plan, "cpu")]
    return _GROUPS[key]


def write(folder: Path, weights: dict[str, torch.Tensor], states: list[dict[str, dict[str, Any]]], groups: Groups,
          settings: list[list[dict[str, Any]]] | None = None) -> None:
    """Write the whole model: `weights` by name, without the tied output layer, and each optimizer's state by name,
    numbered by `groups`. `settings` holds each param group's hyper-parameters; None saves none, and a loader keeps
    its own."""
    from safetensors.torch import save_file

    kept = {name: t.contiguous() for name, t in weights.items() if name != "lm_head.weight"}
    save_file(kept, str(folder / MODEL_WEIGHTS), metadata={"format": "pt"})
    for index, (by_name, optimizer_groups) in enumerate(zip(states, groups, strict=True)):
        flat = [name for group in optimizer_groups for name in group]
        starts = [sum(len(g) for g in optimizer_groups[:i]) for i in range(len(optimizer_groups))]
        hyper = settings[index] if settings is not None else [{} for _ in optimizer_groups]
        param_groups = [{**h, "params": list(range(start, start + len(g)))}
                        for h, start, g in zip(hyper, starts, optimizer_groups, strict=True)]
        state = {i: by_name[name] for i, name in enumerate(flat) if name in by_name}
        torch.save({"state": state, "param_groups": param_groups}, folder / optimizer_file(index))


def load_into_stage(model: PipelinedGPT, folder: Path) -> None:
    """Give a pipeline's stage its part of the whole-model files in `folder` (a pipeline's or a DDP run's)."""
    groups = whole_groups(model.config, model.plan)
    read = [read_optimizer(folder, index, optimizer_groups) for index, optimizer_groups in enumerate(groups)]
    model.load_own(read_weights(folder), [states for states, _ in read], [settings for _, settings in read], folder)


def save_from_stages(model: PipelinedGPT, folder: Path) -> None:
    """Write a pipeline's whole model and optimizer state, gathered from its stages, into `folder`. Call on every
    rank; the main process writes."""
    gathered = model.gather_whole()
    if gathered is not None:
        weights, states, settings = gathered
        write(folder, weights, states, whole_groups(model.config, model.plan), settings)


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / MODEL_WEIGHTS))


def read_optimizer(folder: Path, index: int, groups: list[list[str]]) -> tuple[dict[str, dict], list[dict]]:
    """Optimizer `index`'s state by parameter name, and its param groups' saved hyper-parameters. `groups` is what
    `whole_groups` gives for it."""
    path = folder / optimizer_file(index)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    flat = [name for group in groups for name in group]
    if len(saved["param_groups"]) != len(groups):
        raise UserError(f"{path} holds {len(saved['param_groups'])} param groups, this run's optimizer has "
                        f"{len(groups)}; resume it with the settings it was saved with")
    settings = [{k: v for k, v in group.items() if k != "params"} for group in saved["param_groups"]]
    return {flat[i]: state for i, state in saved["state"].items()}, settings
