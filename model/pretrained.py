"""Building a GPT from resolved weights (`GPT.from_pretrained`), and exporting one as a Hugging Face folder
(`GPT.save_pretrained`).

`load(cls, source)` resolves `source` once (`checkpoint_io.weights.resolve_weights`), reads the weights as our
state dict and builds `cls` holding exactly them:
  - an HF folder or a Hub snapshot: converted by `model.state_dict_adapter`;
  - our checkpoint of any engine: read whole by `checkpoint_io` (`read_checkpoint`), c_attn put back in the
    Hugging Face order if tensor parallelism saved it;
  - a LoRA checkpoint: its base loaded as any other weights, then `model.lora.merge_adapter` merges the adapter.
The network's class comes in as an argument: this module never imports `model/gpt.py` (which imports it),
and `model/lora.py` never imports this one, so the three import each other in no circle.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from huggingface_hub.constants import CONFIG_NAME, SAFETENSORS_SINGLE_FILE
from safetensors.torch import save_file

from checkpoint_io.reader import read_config, read_state
from checkpoint_io.weights import Kind, Weights, resolve_weights
from common.errors import UserError
from common.parallelism import Parallelism
from common.run_dir import GPT_CONFIG
from data.hf_tokenizer import save_tokenizer
from data.tokenizer import EOT_ID, N_VOCAB
from model.config import TIED, TIED_OUTPUT, GPTConfig
from model.state_dict_adapter import (
    config_from_hf,
    config_to_hf,
    read_safetensors,
    state_dict_from_hf,
    state_dict_to_hf,
)
from model.tensor_parallel import reordered

log = logging.getLogger(__name__)


def load(cls: type[torch.nn.Module], source: str | Path | Weights, *, revision: str | None = None,
         block_size: int | None = None, dropout: float | None = None) -> torch.nn.Module:
    """A `cls` (our GPT) holding the weights `source` names (a spec, resolved here, or resolved `Weights`), in
    eval mode (dropout off), as transformers' `from_pretrained` returns a model: loading is mostly for inference,
    where GPT-2's dropout would make each forward pass another draw. A trainer calls `.train()` itself.

    `block_size` keeps the first positions only (at most the weights' own); `dropout` replaces the saved rate."""
    if isinstance(source, Weights) and revision is not None:
        raise TypeError("a revision goes with a spec, not with resolved weights")
    weights = source if isinstance(source, Weights) else resolve_weights(source, revision)
    try:
        if weights.kind is Kind.LORA_CHECKPOINT:
            config, state = _read_lora_checkpoint(cls, weights)
        else:
            config, state = read_plain(weights)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load model {weights.spec!r} ({err}); pass a Hub id, an HF GPT-2 folder, "
                        "a checkpoint folder or a run folder") from err
    if block_size is not None:
        if block_size > config.block_size:
            raise UserError(
                f"block_size={block_size} exceeds the {config.block_size} positions of {weights.spec}; "
                f"use a block_size of at most {config.block_size}"
            )
        # Fewer positions: keep the first rows of the position table, as the model was trained.
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][:block_size]
        config = dataclasses.replace(config, block_size=block_size)
    if dropout is not None:
        config = dataclasses.replace(config, dropout=dropout)
    return build(cls, config, state, weights.name).eval()


def read_plain(weights: Weights) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The config and our state dict of an HF folder, a Hub snapshot or our (full-model) checkpoint."""
    assert weights.kind is not Kind.LORA_CHECKPOINT and weights.folder is not None, weights
    if weights.kind is Kind.CHECKPOINT:
        return read_checkpoint(weights.folder)
    try:
        hf = json.loads((weights.folder / CONFIG_NAME).read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{CONFIG_NAME} of {weights.name} is not valid JSON ({err}); restore the file") from None
    config = config_from_hf(hf, weights.name)
    return config, state_dict_from_hf(read_safetensors(weights.folder, weights.name), config)


def read_checkpoint(folder: Path) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Our training checkpoint, of any engine, read whole on this process (`checkpoint_io.reader`): its config
    and our state dict, c_attn in the Hugging Face order."""
    config = _checkpoint_config(folder)
    saved = read_state(folder)
    return config, reordered(saved.weights, config.n_embd, saved.parallelism, Parallelism())


def _checkpoint_config(folder: Path) -> GPTConfig:
    try:
        return GPTConfig(**read_config(folder))
    except (TypeError, ValueError) as err:  # a ValueError too: not JSON
        raise UserError(f"{folder / GPT_CONFIG} is not a valid GPT config ({err}); restore it from the run") from None


def _read_lora_checkpoint(cls: type[torch.nn.Module], weights: Weights) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """A LoRA run's checkpoint: its base, loaded as the run loaded it (the run's block_size), with the adapter
    merged in (by peft, imported only here)."""
    from model.lora import merge_adapter

    base = load(cls, weights.base, block_size=_checkpoint_config(weights.folder).block_size)
    merged = merge_adapter(base, weights.adapter)
    return merged.config, merged.state_dict()


def build(cls: type[torch.nn.Module], config: GPTConfig, state: dict[str, torch.Tensor],
          source: str) -> torch.nn.Module:
    """A `cls(config)` holding exactly `state`; a UserError naming the keys or shapes that do not fit."""
    # Built on the meta device: random init of gpt2-xl's 1.5B weights would be wasted work.
    with torch.device("meta"):
        model = cls(config)
    expected = {k: v.shape for k, v in model.state_dict().items() if k != TIED_OUTPUT}
    state.pop(TIED_OUTPUT, None)  # tied: it is TIED
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise UserError(
            f"{source} does not hold a GPT-2 model of this architecture (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}); point at a GPT-2 checkpoint or export"
        )
    wrong = [f"{k} {tuple(state[k].shape)} != {tuple(s)}" for k, s in expected.items() if state[k].shape != s]
    if wrong:
        raise UserError(f"{source}: weights do not match its config ({wrong[0]}); the folder is inconsistent")
    state = {k: v.float().contiguous() for k, v in state.items()}
    state[TIED_OUTPUT] = state[TIED]
    model.load_state_dict(state, strict=True, assign=True)
    model.lm_head.weight = model.transformer.wte.weight  # assign=True replaced wte: tie again
    return model


def save_pretrained(model: torch.nn.Module, directory: str | Path, overwrite: bool = False) -> None:
    """Export `model` as a Hugging Face GPT-2 folder that transformers loads with no code of ours."""
    save_state_dict(model.state_dict(), model.config, directory, overwrite)


def save_state_dict(state: dict[str, torch.Tensor], config: GPTConfig, directory: str | Path,
                    overwrite: bool = False) -> None:
    """`save_pretrained` of a GPT of `config` holding `state` (our keys), without building that GPT: a trainer exports
    its own weights with no second copy of them (the file's transposed block matrices are the only copies)."""
    from transformers import GenerationConfig

    directory = Path(directory)
    weights_file = directory / SAFETENSORS_SINGLE_FILE
    if not overwrite and any(p.exists() for p in (directory / CONFIG_NAME, weights_file)):
        raise UserError(f"{directory} already holds a model; choose a new folder or pass overwrite=True")
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state_dict_to_hf(state, config), weights_file, metadata={"format": "pt"})
    config_to_hf(config).save_pretrained(directory)
    # max_length: a generation without length arguments (transformers' pipeline adds 256 new tokens) stops at the
    # context, where the position table ends.
    GenerationConfig(bos_token_id=EOT_ID, eos_token_id=EOT_ID, pad_token_id=EOT_ID, do_sample=True, top_k=50,
                     max_length=config.block_size).save_pretrained(directory)
    if config.vocab_size >= N_VOCAB:
        save_tokenizer(directory, model_max_length=config.block_size)
    else:
        log.warning("vocab_size %d is smaller than GPT-2's %d: no tokenizer files written", config.vocab_size, N_VOCAB)
