"""A LoRA run (`--lora_rank N`): adapters on the network, checkpoints holding only them, resumes that match.

What changes against a full fine-tune, and where:
- `add_run_adapters` (from `training.network.build_model`): peft's adapters on the `--init_from` weights, everything
  else frozen (`build_optimizer` takes trainable parameters only, so the optimizer state is the adapters' too).
- `use_adapter_checkpoints` (from train.py, before the resume point is loaded): accelerate's `save_state` writes
  the adapter (`adapter_model.safetensors`, `adapter_config.json`) in place of `model.safetensors`, and
  `load_state` loads it back; optimizer, RNG and data states are saved as for any run, and the manifest covers
  every file.
- `check_resume` (from `training.network.build_model`, before any weights are read): a LoRA checkpoint resumes
  only as a LoRA run with the same settings on the same base, a full one only as a full run.
- `training.export.export_final` writes `final/` merged and `final_adapter/` (see `model.lora`), whose config names
  its base so that it loads by itself (`loadable_base`).

peft is imported only here and in `model.lora`, and only for a LoRA run (the GPU image may lack it).
"""
from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator

from common.errors import UserError
from common.run_dir import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from common.weights import Kind, Weights
from configs import ModelConfig
from model import GPT
from model.unwrap import unwrapped


def base_name(weights: Weights) -> str:
    """How the adapter config names its base weights: an absolute path for a local folder (a resume or a loader
    from another working directory finds the same folder), the Hub id otherwise (its revision goes beside it)."""
    return weights.spec if weights.kind is Kind.HUB else str(Path(weights.spec).expanduser().resolve())


def loadable_base(weights: Weights) -> tuple[str, str | None]:
    """How `final_adapter/` names its base (`base_model_name_or_path`, `revision`), for a loader that has only that
    folder: peft's `AutoPeftModelForCausalLM` loads the base with transformers from those two. A Hub repo is its id
    at the commit the run downloaded; local weights are the absolute path of the folder they were read from (for a
    run folder given as `--init_from`, its final/: transformers cannot load a run folder). The checkpoints keep
    `base_name`, the name a resume is checked against."""
    if weights.kind is Kind.HUB:
        return weights.spec, weights.commit or weights.revision
    return str(weights.folder.resolve()), None


def _config(cfg: ModelConfig, weights: Weights):
    from model.lora import lora_config

    return lora_config(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_list, base_name(weights),
                       weights.revision)


def lora_summary(cfg: ModelConfig) -> str | None:
    """What a LoRA run adds, for the run's header (None for a full fine-tune or a run from scratch)."""
    return f"LoRA r={cfg.lora_rank} on {cfg.lora_targets}" if cfg.lora_rank else None


def add_run_adapters(model: GPT, cfg: ModelConfig, weights: Weights) -> GPT:
    """`model` (loaded from `weights`) with the run's adapters injected (in place); only they require gradients."""
    from model.lora import add_adapters

    return add_adapters(model, _config(cfg, weights))


def check_resume(cfg: ModelConfig, weights: Weights | None, checkpoint: Path) -> None:
    """Refuse to resume a LoRA checkpoint as a full run or the reverse, or with other LoRA settings or base."""
    saved_lora = (checkpoint / ADAPTER_CONFIG).is_file()
    if cfg.lora_rank and not saved_lora:
        raise UserError(f"{checkpoint} is a checkpoint of a full fine-tune (every weight), not of a LoRA run; resume "
                        "it without --lora_rank, or start the LoRA run in a new --out_dir")
    if saved_lora and not cfg.lora_rank:
        raise UserError(f"{checkpoint} is a checkpoint of a LoRA run (adapters only); resume it with the flags it was "
                        "trained with (--lora_rank, --lora_alpha, --lora_targets, --init_from its base)")
    if not saved_lora:
        return
    from model.lora import read_adapter_config

    saved, now = read_adapter_config(checkpoint), _config(cfg, weights)
    fields = {"lora_rank": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
              "lora_targets": "target_modules", "init_from": "base_model_name_or_path"}
    diffs = [f"{flag}: checkpoint {getattr(saved, attr)!r} vs now {getattr(now, attr)!r}"
             for flag, attr in fields.items() if getattr(saved, attr) != getattr(now, attr)]
    if diffs:
        raise UserError(f"{checkpoint} was trained with other LoRA settings ({'; '.join(diffs)}); use the same "
                        "flags to resume")


def use_adapter_checkpoints(accelerator: Accelerator, cfg: ModelConfig) -> None:
    """For a LoRA run, make `save_state`/`load_state` save and load a model with adapters as its adapter only (no
    base weights); nothing for any other run."""
    if not cfg.lora_rank:
        return

    def adapted(model: torch.nn.Module) -> GPT | None:
        module = unwrapped(model)
        return module if hasattr(module, "peft_config") else None

    def save_adapters_only(models: list, weights: list, output_dir: str) -> None:
        # accelerate saves weights[i] as model(_i).safetensors: a model whose entry is removed is saved here instead.
        from safetensors.torch import save_file

        from model.lora import adapter_state, save_adapter_config

        for i in reversed(range(len(models))):
            if (module := adapted(models[i])) is not None:
                if accelerator.is_main_process:
                    save_file(adapter_state(module), Path(output_dir) / ADAPTER_WEIGHTS, metadata={"format": "pt"})
                    save_adapter_config(module, Path(output_dir))
                weights.pop(i)

    def load_adapters(models: list, input_dir: str) -> None:
        # accelerate loads every model left in `models` from model(_i).safetensors: this one is loaded here.
        from safetensors.torch import load_file

        from model.lora import load_adapter_state

        for model in list(models):
            if (module := adapted(model)) is not None:
                load_adapter_state(module, load_file(Path(input_dir) / ADAPTER_WEIGHTS), input_dir)
                models.remove(model)

    accelerator.register_save_state_pre_hook(save_adapters_only)
    accelerator.register_load_state_pre_hook(load_adapters)
