"""Building a GPT from resolved weights (`GPT.from_pretrained`), and exporting one as a Hugging Face folder
(`GPT.save_pretrained`).

`load(cls, source)` resolves `source` once (`checkpoint_io.weights.resolve_weights`), reads the weights as our
state dict and builds `cls` holding exactly them:
  - an HF folder or a Hub snapshot: converted by `model.state_dict_adapter`;
  - our checkpoint: accelerate's model.safetensors of our state dict, maybe `_orig_mod.`/`module.` prefixed
    (save_state keeps the wrappers' names), the tied `lm_head.weight` dropped; or an FSDP2 or ZeRO checkpoint,
    merged on one process (`read_checkpoint`);
  - a LoRA checkpoint: its base loaded as any other weights, then `model.lora.merge_adapter` merges the adapter.
The network's class comes in as an argument: this module never imports `model/gpt.py` (which imports it),
and `model/lora.py` never imports this one, so the three import each other in no circle.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from huggingface_hub.constants import CONFIG_NAME, SAFETENSORS_SINGLE_FILE
from safetensors.torch import save_file

from checkpoint_io.weights import Kind, Weights, resolve_weights
from common.errors import UserError
from common.run_dir import DEEPSPEED_DIR, FSDP_MODEL_DIR, GPT_CONFIG, RUN_STATE
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
from model.tensor_parallel import natural_order

log = logging.getLogger(__name__)

WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DDP wrappers


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


def strip_wrapper_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our key names from a wrapped model's state dict (`_orig_mod.` of torch.compile, `module.` of DDP)."""

    def strip(key: str) -> str:
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        return key

    return {strip(k): v for k, v in state.items()}


def read_checkpoint(folder: Path) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Our training checkpoint, of any engine, read whole on this one process: gpt_config.json and the model's state
    dict: accelerate's model.safetensors (DDP, one process, a pipeline's gathered files); FSDP2's sharded folder,
    merged by torch's distributed checkpoint (under tensor parallelism, c_attn put back in the Hugging Face order);
    DeepSpeed's ZeRO partitions, merged into the fp32 master weights by DeepSpeed's own zero_to_fp32."""
    config = _checkpoint_config(folder)
    if (folder / FSDP_MODEL_DIR).is_dir():
        state = natural_order(strip_wrapper_prefixes(_read_fsdp(folder / FSDP_MODEL_DIR)), config.n_embd,
                              _tensor_parallel_degree(folder))
    elif (folder / DEEPSPEED_DIR).is_dir():
        state = _read_deepspeed(folder)
    else:
        state = read_safetensors(folder, str(folder))
    return config, strip_wrapper_prefixes(state)


def _read_fsdp(shards: Path) -> dict[str, torch.Tensor]:
    """FSDP2's model shards (torch's distributed checkpoint, under the key "model"), merged on one process."""
    state = read_distributed_checkpoint(shards)
    return state.get("model", state)


def read_distributed_checkpoint(shards: Path) -> dict:
    """A folder of torch's distributed checkpoint (FSDP2's model or optimizer shards), merged on one process."""
    import tempfile

    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        merged = Path(scratch) / "model.pt"
        try:
            dcp_to_torch_save(str(shards), str(merged))
        except (OSError, RuntimeError, ValueError, CheckpointException) as err:  # the last: a BaseException
            raise UserError(f"the model shards in {shards} cannot be read ({type(err).__name__}); use another "
                            "checkpoint") from None
        return torch.load(merged, map_location="cpu", weights_only=True)


def _read_deepspeed(folder: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's ZeRO checkpoint (`pytorch_model/`, one partition per rank), merged into its fp32 master weights."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise UserError(f"{folder} is a DeepSpeed checkpoint, and reading it needs DeepSpeed; pip install -e "
                        "\".[deepspeed]\"") from None
    with deepspeed_quietly():
        return get_fp32_state_dict_from_zero_checkpoint(str(folder))


@contextlib.contextmanager
def deepspeed_quietly() -> Iterator[None]:
    """DeepSpeed's checkpoint readers print what they parse and draw progress bars, on every rank: not a user's
    business (their errors are exceptions, which pass)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _tensor_parallel_degree(folder: Path) -> int:
    """The tensor-parallel degree the checkpoint was saved under (run_state.json's engine record; 1 before it)."""
    try:
        engine = json.loads((folder / RUN_STATE).read_text()).get("engine") or {}
    except (OSError, json.JSONDecodeError, AttributeError):
        return 1
    return int(engine.get("tensor_parallel") or 1)


def _checkpoint_config(folder: Path) -> GPTConfig:
    try:
        return GPTConfig(**json.loads((folder / GPT_CONFIG).read_text()))
    except (json.JSONDecodeError, TypeError, ValueError) as err:
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
    GenerationConfig(bos_token_id=EOT_ID, eos_token_id=EOT_ID, pad_token_id=EOT_ID, do_sample=True,
                     top_k=50).save_pretrained(directory)
    if config.vocab_size >= N_VOCAB:
        save_tokenizer(directory, model_max_length=config.block_size)
    else:
        log.warning("vocab_size %d is smaller than GPT-2's %d: no tokenizer files written", config.vocab_size, N_VOCAB)
