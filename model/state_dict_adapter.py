"""Hugging Face GPT-2 <-> our GPT: configs, state dicts, and reading safetensors files.

Our module and parameter names are GPT2LMHeadModel's (`transformer.h.0.attn.c_attn.weight`, ...). So a
state dict converts with these rules and nothing else:
  - HF's Conv1D stores the four block matrices as (in, out): our nn.Linear's (out, in) transposed;
  - our embedding has `padded_vocab_size` rows (zeros past `vocab_size`), HF's exactly `vocab_size`;
  - `lm_head.weight` is tied to `transformer.wte.weight`: neither side needs it in a file;
  - GPT-2 always has biases: a bias-less GPT exports zeros (the same function), dropped on load;
  - OpenAI's original files name keys without `transformer.` and carry causal-mask buffers (skipped).
Weights are read from safetensors only, one file or the shards of an index: a pickle can run code.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE
from safetensors.torch import load_file

from common.errors import UserError
from data.tokenizer import N_VOCAB
from model.config import GPTConfig

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # the same function as F.gelu(approximate="tanh")
OUR_KEY = "gpt2_accelerate"  # our extra config.json entry: what GPT-2's config cannot express


def config_from_hf(hf: dict[str, Any], where: str) -> GPTConfig:
    """GPTConfig for an HF config dict; a one-line UserError for anything we would compute differently."""
    if hf.get("model_type") != "gpt2":
        raise UserError(
            f"{where} holds a {hf.get('model_type')!r} model, not GPT-2; only GPT-2-architecture models load here"
        )
    n_embd = hf.get("n_embd", 768)
    unsupported = {
        "activation_function": hf.get("activation_function", "gelu_new") not in TANH_GELUS,
        "n_inner": hf.get("n_inner") not in (None, 4 * n_embd),
        "layer_norm_epsilon": abs(hf.get("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12,
        "scale_attn_weights": not hf.get("scale_attn_weights", True),
        "scale_attn_by_inverse_layer_idx": hf.get("scale_attn_by_inverse_layer_idx", False),
        "add_cross_attention": hf.get("add_cross_attention", False),
        "tie_word_embeddings": not hf.get("tie_word_embeddings", True),
    }
    bad = [f"{k}={hf.get(k)!r}" for k, is_bad in unsupported.items() if is_bad]
    if bad:
        raise UserError(f"{where} is a GPT-2 variant this model does not implement ({', '.join(bad)}); "
                        "use a standard GPT-2")
    ours = hf.get(OUR_KEY, {})
    return GPTConfig(
        block_size=hf.get("n_positions", 1024),
        vocab_size=hf.get("vocab_size", N_VOCAB),
        n_layer=hf.get("n_layer", 12),
        n_head=hf.get("n_head", 12),
        n_embd=n_embd,
        dropout=hf.get("resid_pdrop", 0.1),
        bias=ours.get("bias", True),
        pad_vocab_multiple=ours.get("pad_vocab_multiple", GPTConfig.pad_vocab_multiple),
    )


def config_to_hf(config: GPTConfig) -> Any:
    """transformers' GPT2Config computing what `config` computes (with our extras under OUR_KEY)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.block_size,
        n_ctx=config.block_size,  # the context length under GPT-2's original name, which llama.cpp's converter reads
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        activation_function="gelu_new",
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        tie_word_embeddings=True,
        architectures=["GPT2LMHeadModel"],
        **{OUR_KEY: {"bias": config.bias, "pad_vocab_multiple": config.pad_vocab_multiple}},
    )


def state_dict_from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict from an HF GPT-2 one, for a GPT of `config` (without the tied lm_head.weight)."""
    state: dict[str, torch.Tensor] = {}
    for key, tensor in hf_state.items():
        key = key.removeprefix("transformer.")  # older GPT-2 files (the OpenAI ones) have no prefix
        if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
            continue  # causal-mask buffers of old HF versions; lm_head is tied to wte
        if key.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        state["transformer." + key] = tensor
    wte = state.get("transformer.wte.weight")
    if wte is not None and wte.size(0) < config.padded_vocab_size:
        # The padding rows are never inputs nor returned as logits: zeros are as good as any.
        pad = wte.new_zeros(config.padded_vocab_size - wte.size(0), wte.size(1))
        state["transformer.wte.weight"] = torch.cat([wte, pad])
    if not config.bias:
        state = {k: v for k, v in state.items() if not k.endswith(".bias")}  # our export wrote zeros
    return state


def state_dict_to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """The HF GPT-2 state dict (CPU, contiguous) of our state dict for a GPT of `config`."""
    tensors = {}
    for key, tensor in state.items():
        if key == "lm_head.weight":
            continue  # tied to wte: transformers ties it again on load
        if key == "transformer.wte.weight":
            tensor = tensor[: config.vocab_size]  # HF models have exactly vocab_size rows
        if key.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        tensors[key] = tensor.detach().to("cpu").contiguous()
    if not config.bias:
        # GPT-2 always has biases: zeros compute the same function as none.
        for key, tensor in list(tensors.items()):
            if key.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) or key.endswith(CONV1D_WEIGHTS):
                tensors[key.removesuffix("weight") + "bias"] = tensor.new_zeros(tensor.size(-1))
    return tensors


def read_safetensors(folder: Path, source: str) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors`, or of the shards a `model.safetensors.index.json` lists.

    A folder without them is one line. An FSDP sharded checkpoint gets the merge command. Pickled weights
    (`*.bin`, `*.pt*`) are named and never loaded."""
    from safetensors import SafetensorError

    single, index = folder / SAFETENSORS_SINGLE_FILE, folder / SAFETENSORS_INDEX_FILE
    try:
        if single.is_file():
            return load_file(single)
        if index.is_file():
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
                state.update(load_file(folder / shard))
            return state
    except (SafetensorError, KeyError, json.JSONDecodeError, OSError) as err:
        raise UserError(f"the weights in {source} are damaged ({err.__class__.__name__}: {err}); "
                        "restore them or use another checkpoint") from None
    pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt*")]
    hint = f" ({', '.join(pickles)} not loaded: pickled weights can run code)" if pickles else ""
    raise UserError(f"no {SAFETENSORS_SINGLE_FILE} in {source}{hint}; provide the weights as safetensors")
