"""Loading GPT weights from anywhere a user may point at, and exporting to a Hugging Face folder.

Sources for `load_pretrained`, tried in this order for an existing folder:
  1. our training checkpoint: `gpt_config.json` + accelerate's `model.safetensors` (our key names,
     maybe `_orig_mod.`/`module.` prefixed, the tied `lm_head.weight` dropped); a LoRA run's checkpoint
     (`adapter_config.json` + `adapter_model.safetensors`) is its base weights, loaded again from where
     the adapter config names them, with the adapter merged in;
  2. a Hugging Face GPT-2 folder: `config.json` (model_type gpt2) + safetensors, e.g. our export;
  3. our run folder: `final/` if training finished, else the newest `checkpoints/step_*`.
Anything else that is not a folder is treated as a Hub id and downloaded (safetensors only:
a pickle can run code when loaded). HF's Conv1D stores weights as (in, out), transposed from
nn.Linear, which is the only real conversion.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from common.errors import UserError
from common.run_dir import ADAPTER_CONFIG, ADAPTER_WEIGHTS, GPT_CONFIG, RunDir
from model.gpt import GPT, GPTConfig

log = logging.getLogger(__name__)

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DDP wrappers
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # the same function as F.gelu(approximate="tanh")
OUR_KEY = "gpt2_accelerate"  # our extra config.json entry: what GPT-2's config cannot express
GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
HUB_FILES = ["config.json", "model.safetensors", "model.safetensors.index.json", "model-*.safetensors"]


def load_for_cli(spec: str) -> GPT:
    """`load_pretrained(spec)` for a command line (`--model`): a model that cannot be loaded is one line."""
    try:
        return load_pretrained(spec)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load model {spec!r} ({err}); pass a Hub id, an HF GPT-2 folder, "
                        "a checkpoint folder or a run folder") from err


def load_pretrained(name_or_path: str | Path, block_size: int | None = None, dropout: float | None = None) -> GPT:
    """Build a `GPT` from a Hub id or a local folder (see the module docstring)."""
    folder = _resolve(name_or_path)
    if (folder / GPT_CONFIG).is_file() and (folder / ADAPTER_CONFIG).is_file():
        merged = _read_lora_checkpoint(folder)
        config, state = merged.config, merged.state_dict()
    elif (folder / GPT_CONFIG).is_file():
        config, state = _read_checkpoint(folder)
    else:
        # Name a Hub download by its id, not by its cache path.
        local = Path(name_or_path).expanduser().exists()
        config, state = _read_hf_folder(folder, str(folder) if local else str(name_or_path))
    if block_size is not None:
        if block_size > config.block_size:
            raise UserError(
                f"block_size={block_size} exceeds the {config.block_size} positions of {name_or_path}; "
                f"use a block_size of at most {config.block_size}"
            )
        # Fewer positions: keep the first rows of the position table, as the model was trained.
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][:block_size]
        config = dataclasses.replace(config, block_size=block_size)
    if dropout is not None:
        config = dataclasses.replace(config, dropout=dropout)
    return _build(config, state, str(name_or_path))


def _resolve(name_or_path: str | Path) -> Path:
    """A local folder holding a config, or the snapshot folder of a Hub download."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / GPT_CONFIG).is_file() or (path / "config.json").is_file():
            return path
        run = RunDir(path)
        if run.looks_like_run():
            newest = run.newest_weights()
            if newest is None:
                raise UserError(f"run folder {path} has no final/ export and no checkpoints/step_* yet; train longer "
                                "or pick another run")
            return newest
        raise UserError(
            f"{path} is neither a model folder (config.json or gpt_config.json) nor a run folder "
            f"(final/ or checkpoints/); point at one of those"
        )
    if path.exists():
        raise UserError(f"{path} is a file; pass the folder that holds config.json and model.safetensors")
    parent = Path(path.parts[0]) if len(path.parts) > 1 and not path.is_absolute() else None
    if parent is not None and parent.is_dir():  # `out/my_rnu` while out/ exists: a typo, not a Hub id
        raise UserError(f"no folder {path} (though {parent}/ exists); check the path, or pass a Hub id such as gpt2")
    return _download(str(name_or_path))


def is_repo_id(name: str) -> bool:
    """True for a syntactically valid Hub repo id (`name` or `namespace/name`), by huggingface_hub's rules."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _download(repo_id: str) -> Path:
    """Fetch config and safetensors of a Hub repo (or find them in the local Hub cache)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    known = f"known names: {', '.join(GPT2_NAMES)}, any Hub repo of a GPT-2 model, or a local folder"
    if not is_repo_id(repo_id):
        raise UserError(f"{repo_id!r} is not an existing folder nor a valid Hub model id; {known}")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        raise UserError(
            f"cannot fetch {repo_id!r} from the Hugging Face Hub: offline (HF_HUB_OFFLINE=1 or no network) and "
            f"not in the local Hub cache; download it once with network access "
            f"(`hf download {repo_id}`) or pass a local folder"
        ) from None
    except GatedRepoError:
        raise UserError(f"{repo_id!r} is gated on the Hub; accept its terms and log in (`hf auth login`)") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise UserError(f"unknown model {repo_id!r}: not a local folder and not a model on the Hub; {known}") from None
    except HfHubHTTPError as err:
        raise UserError(f"downloading {repo_id!r} from the Hub failed ({str(err).splitlines()[0]}); "
                        "retry later") from None


def _read_safetensors(folder: Path, source: str) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors`, or of the shards a `model.safetensors.index.json` lists."""
    from safetensors import SafetensorError

    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
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
    if (folder / "pytorch_model_fsdp_0").is_dir():
        raise UserError(f"{source} is an FSDP sharded checkpoint; merge it first (`accelerate merge-weights "
                        f"{folder / 'pytorch_model_fsdp_0'} <out_dir>`) or use the run's final/ export")
    pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt*")]
    hint = f" ({', '.join(pickles)} not loaded: pickled weights can run code)" if pickles else ""
    raise UserError(f"no model.safetensors in {source}{hint}; provide the weights as safetensors")


def strip_wrapper_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our key names from a wrapped model's state dict (`_orig_mod.` of torch.compile, `module.` of DDP)."""

    def strip(key: str) -> str:
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        return key

    return {strip(k): v for k, v in state.items()}


def _read_checkpoint(folder: Path) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Our training checkpoint: gpt_config.json + safetensors of our (possibly wrapped) state dict."""
    try:
        raw = json.loads((folder / GPT_CONFIG).read_text())
        config = GPTConfig(**raw)
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise UserError(f"{folder / GPT_CONFIG} is not a valid GPT config ({err}); restore it from the run") from None
    state = strip_wrapper_prefixes(_read_safetensors(folder, str(folder)))
    return config, state


def _read_lora_checkpoint(folder: Path) -> GPT:
    """A LoRA run's checkpoint: its base weights (named in the adapter config) with the adapter merged in."""
    from model.lora import add_adapters, load_adapter_state, merged, read_adapter_config  # peft only when needed

    config = read_adapter_config(folder)
    block_size = json.loads((folder / GPT_CONFIG).read_text()).get("block_size")
    try:
        model = load_pretrained(config.base_model_name_or_path, block_size=block_size)
    except UserError as err:
        raise UserError(f"{folder} is a LoRA checkpoint whose base model {config.base_model_name_or_path} cannot be "
                        f"loaded ({err}); restore the base, or use the run's final/ export") from None
    add_adapters(model, config)
    load_adapter_state(model, _read_safetensors_file(folder / ADAPTER_WEIGHTS, str(folder)), str(folder))
    return merged(model)


def _read_safetensors_file(file: Path, source: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError

    try:
        return load_file(file)
    except (SafetensorError, OSError) as err:
        raise UserError(f"the weights in {source} are damaged or missing ({err.__class__.__name__}: {err}); "
                        "restore them or use another checkpoint") from None


def _read_hf_folder(folder: Path, source: str) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """A Hugging Face GPT-2 folder: check the architecture is the one we implement, convert weights."""
    try:
        hf = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"config.json of {source} is not valid JSON ({err}); restore the file") from None
    config = config_from_hf(hf, source)
    state: dict[str, torch.Tensor] = {}
    for key, tensor in _read_safetensors(folder, source).items():
        key = key.removeprefix("transformer.")  # older GPT-2 files (the OpenAI ones) have no prefix
        if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
            continue  # causal-mask buffers of old HF versions; lm_head is tied to wte
        if key.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        state["transformer." + key] = tensor
    wte = state.get("transformer.wte.weight")
    if wte is not None and wte.size(0) < config.padded_vocab_size:
        # The padding rows are never used as inputs nor returned as logits; zeros are as good as any.
        pad = wte.new_zeros(config.padded_vocab_size - wte.size(0), wte.size(1))
        state["transformer.wte.weight"] = torch.cat([wte, pad])
    if not config.bias:
        state = {k: v for k, v in state.items() if not k.endswith(".bias")}  # our export wrote zeros
    return config, state


def config_from_hf(hf: dict, where: str) -> GPTConfig:
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
        vocab_size=hf.get("vocab_size", 50257),
        n_layer=hf.get("n_layer", 12),
        n_head=hf.get("n_head", 12),
        n_embd=n_embd,
        dropout=hf.get("resid_pdrop", 0.1),
        bias=ours.get("bias", True),
        pad_vocab_multiple=ours.get("pad_vocab_multiple", GPTConfig.pad_vocab_multiple),
    )


def _build(config: GPTConfig, state: dict[str, torch.Tensor], source: str) -> GPT:
    """A GPT holding exactly `state`; a UserError naming the keys or shapes that do not fit."""
    # Built on the meta device: random init of gpt2-xl's 1.5B weights would be wasted work.
    with torch.device("meta"):
        model = GPT(config)
    expected = {k: v.shape for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state.pop("lm_head.weight", None)  # tied: it is wte
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
    state["lm_head.weight"] = state["transformer.wte.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.lm_head.weight = model.transformer.wte.weight  # assign=True replaced wte: tie again
    return model


def save_pretrained(model: GPT, directory: str | Path, overwrite: bool = False) -> None:
    """Export `model` as a Hugging Face GPT-2 folder that transformers loads with no code of ours."""
    from transformers import GenerationConfig, GPT2Config

    directory = Path(directory)
    if not overwrite and any((directory / name).exists() for name in ("config.json", "model.safetensors")):
        raise UserError(f"{directory} already holds a model; choose a new folder or pass overwrite=True")
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    tensors = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied to wte: transformers ties it again on load
        if key == "transformer.wte.weight":
            tensor = tensor[: cfg.vocab_size]  # HF models have exactly vocab_size rows
        if key.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        tensors[key] = tensor.detach().to("cpu").contiguous()
    if not cfg.bias:
        # GPT-2 always has biases: zeros compute the same function as none.
        for key, tensor in list(tensors.items()):
            if key.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) or key.endswith(CONV1D_WEIGHTS):
                tensors[key.removesuffix("weight") + "bias"] = tensor.new_zeros(tensor.size(-1))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})

    hf_config = GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.block_size,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        activation_function="gelu_new",
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        tie_word_embeddings=True,
        architectures=["GPT2LMHeadModel"],
        **{OUR_KEY: {"bias": cfg.bias, "pad_vocab_multiple": cfg.pad_vocab_multiple}},
    )
    hf_config.save_pretrained(directory)
    eot = 50256
    generation = GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, do_sample=True, top_k=50)
    generation.save_pretrained(directory)
    if cfg.vocab_size >= 50257:
        from data.hf_tokenizer import save_tokenizer

        save_tokenizer(directory, model_max_length=cfg.block_size)
    else:
        log.warning("vocab_size %d is smaller than GPT-2's 50257: no tokenizer files written", cfg.vocab_size)
