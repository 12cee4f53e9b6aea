"""LoRA adapters on our GPT, through `peft`: add them, read and load their weights, merge them, export them.

peft injects its LoRA layers into the GPT in place (`peft.inject_adapter_in_model`). The model stays a `GPT`:
forward, generate and the evaluations are unchanged. Its targeted `nn.Linear` layers become peft `lora.Linear`
layers. Each holds the frozen base layer and the trainable `lora_A`/`lora_B` matrices; only those require
gradients. The adapter's settings travel with the model as `model.peft_config["default"]`.
`base_model_name_or_path` names the weights it was added to.

Invariants:
- `adapter_state` has our module paths (`transformer.h.0.attn.c_attn.lora_A.weight`). They are also
  transformers' GPT2LMHeadModel paths. So a PEFT adapter folder written by `save_adapter_folder` loads on
  GPT2LMHeadModel with `PeftModel.from_pretrained`. Its config says `fan_in_fan_out: true`: transformers'
  Conv1D stores weights transposed from our nn.Linear. The A/B matrices are the same.
- `merged(model)` is a plain GPT (no peft layers) computing what `model` computes, without changing `model`.
- Adapters go only on nn.Linear layers inside the transformer blocks. `lm_head` is tied to the token
  embedding: an adapter there would untie them and break the GPT-2 export.
- This module never imports the network (`model/gpt.py`). It works on the model it is given, and builds a
  copy with `type(model)`. Loading a LoRA checkpoint (`model.pretrained`) loads the base, then calls
  `merge_adapter`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from checkpoint_io.weights import Kind, Weights
from common.errors import UserError
from common.run_dir import ADAPTER_CONFIG, ADAPTER_WEIGHTS

if TYPE_CHECKING:  # peft is imported where it is used: only a LoRA run (or a LoRA checkpoint) needs it
    from peft import LoraConfig, PeftModel

ADAPTER = "default"  # peft's name for the one adapter of a model
DEFAULT_TARGETS = ("c_attn", "c_proj", "c_fc")  # attention (qkv, output) and MLP (in, out) projections


def lora_config(rank: int, alpha: float, dropout: float, targets: list[str] | tuple[str, ...], base: str,
                revision: str | None = None) -> LoraConfig:
    """peft's LoraConfig for our GPT. `base` names the weights the adapter is added to.

    `revision` is a Hub base's revision. Both are recorded in adapter_config.json, where
    `checkpoint_io.weights` finds the base again."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets), bias="none",
                      base_model_name_or_path=base, revision=revision)


def _targeted_layers(model: torch.nn.Module, config: LoraConfig) -> dict[str, torch.nn.Module]:
    """The modules `config.target_modules` names (peft's own matching rule: a name or a dotted suffix)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    return {name: module for name, module in model.named_modules() if name and check_target_module_exists(config, name)}


def add_adapters(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """Inject LoRA adapters into `model` in place and freeze everything else; returns `model`.

    Refused in one line: targets that match no layer, or something other than a block's linear layer. Also a rank
    larger than the smallest dimension of a targeted layer: the update would have no low rank left."""
    targets = ", ".join(sorted(config.target_modules))
    layers = _targeted_layers(model, config)
    linear_names = sorted({name.rsplit(".", 1)[-1] for name, m in model.transformer.h.named_modules()
                           if isinstance(m, torch.nn.Linear)})
    if not layers:
        raise UserError(f"--lora_targets {targets} matches no layer of the model; choose among "
                        f"{', '.join(linear_names)}")
    wrong = [name for name, m in layers.items()
             if not (name.startswith("transformer.h.") and isinstance(m, torch.nn.Linear))]
    if wrong:
        raise UserError(f"--lora_targets {targets} matches {wrong[0]}, which is not a linear layer of a transformer "
                        f"block; choose among {', '.join(linear_names)}")
    smallest = min(min(m.in_features, m.out_features) for m in layers.values())
    if config.r > smallest:
        raise UserError(f"--lora_rank {config.r} does not fit: the targeted layers have {smallest} features on their "
                        f"smallest side; pass a rank of at most {smallest} (LoRA ranks are usually 4 to 64)")
    from peft import inject_adapter_in_model

    return inject_adapter_in_model(config, model, adapter_name=ADAPTER)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights only (no base weights), keyed by module path without the adapter name."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(
        model, adapter_name=ADAPTER, save_embedding_layers=False).items()}


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Put `state` (from `adapter_state`) into `model`'s adapters; every adapter weight must be there, nothing else."""
    expected = set(adapter_state(model))
    if set(state) != expected:
        odd = sorted(set(state) ^ expected)[:2]
        raise UserError(f"the adapter in {source} does not fit this model's adapters ({', '.join(odd)}); use the "
                        "LoRA settings (--lora_rank, --lora_targets) it was trained with")
    from peft.utils import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    assert not result.unexpected_keys, result.unexpected_keys  # checked above: every key is an adapter weight


def _peft_model(model: torch.nn.Module) -> PeftModel:
    """A PeftModel over a fresh copy of `model`'s base weights, holding `model`'s adapter.

    So peft's merge and save_pretrained run without touching the model being trained."""
    from peft import LoraConfig, get_peft_model

    config = model.peft_config[ADAPTER]
    base_state = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if ".lora_" not in k}
    with torch.device("meta"):
        base = type(model)(model.config)
    base.load_state_dict(base_state, assign=True)
    base.lm_head.weight = base.transformer.wte.weight  # assign=True replaced wte: tie again
    base.name_or_path = config.base_model_name_or_path  # what get_peft_model records as the adapter's base
    peft_model = get_peft_model(base, LoraConfig(**{**config.to_dict(), "inference_mode": True}), adapter_name=ADAPTER)
    load_adapter_state(peft_model.get_base_model(), adapter_state(model), "the model")  # the same GPT, in place
    return peft_model


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """A plain GPT: `model`'s base weights plus its adapters' update (W + B A * alpha / r)."""
    return _peft_model(model).merge_and_unload()


def merge_adapter(base: torch.nn.Module, adapter: Path) -> torch.nn.Module:
    """`base` (a plain GPT, changed in place) with the adapter in the folder `adapter` merged in.

    `adapter` is a LoRA run's checkpoint. The result is a plain GPT."""
    add_adapters(base, read_adapter_config(adapter))
    try:
        state = load_file(adapter / ADAPTER_WEIGHTS)
    except (SafetensorError, OSError) as err:
        raise UserError(f"the weights in {adapter} are damaged or missing ({err.__class__.__name__}: {err}); "
                        "restore them or use another checkpoint") from None
    load_adapter_state(base, state, str(adapter))
    return merged(base)


def save_adapter_folder(model: torch.nn.Module, directory: Path, base: str, revision: str | None) -> None:
    """Write `model`'s adapter as a PEFT adapter folder for transformers' GPT2LMHeadModel (the module docstring).

    It names `base` as the model it goes on: a Hub id, at `revision`, or a folder transformers loads."""
    _peft_model(model).save_pretrained(directory, save_embedding_layers=False)  # only the adapter
    _rewrite_config(directory, fan_in_fan_out=True,  # GPT2LMHeadModel's Conv1D layers hold W transposed
                    task_type="CAUSAL_LM",  # PeftModel.from_pretrained then gives a PeftModelForCausalLM (generate)
                    auto_mapping=None,  # peft recorded our GPT class here: transformers' GPT-2 is the base to load
                    base_model_name_or_path=base, revision=revision)  # what AutoPeftModelForCausalLM loads


def save_adapter_config(model: torch.nn.Module, directory: Path) -> None:
    """Write `model`'s LoraConfig as `adapter_config.json` (what a checkpoint of a LoRA run records)."""
    model.peft_config[ADAPTER].save_pretrained(str(directory))
    _rewrite_config(directory)


def _rewrite_config(directory: Path, **changes: object) -> None:
    # peft writes target_modules in a set's order, which changes from process to process. Sorted, a resumed run
    # writes the very bytes of an uninterrupted one.
    config_file = directory / ADAPTER_CONFIG
    config = json.loads(config_file.read_text())
    config.update(changes, target_modules=sorted(config["target_modules"]))
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))


def read_adapter_config(folder: Path) -> LoraConfig:
    """The LoraConfig saved in `folder` (a checkpoint of a LoRA run)."""
    from peft import LoraConfig

    try:
        return LoraConfig.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as err:
        raise UserError(f"{folder / ADAPTER_CONFIG} is damaged ({type(err).__name__}); resume from another "
                        "checkpoint") from None


def base_name(weights: Weights) -> str:
    """How the adapter config names its base weights.

    A local folder is named by its absolute path: a resume or a loader in another working directory finds it.
    A Hub base is named by its id; its revision goes beside it."""
    return weights.spec if weights.kind is Kind.HUB else str(Path(weights.spec).expanduser().resolve())


def run_lora_config(rank: int, alpha: float, dropout: float, targets: list[str] | tuple[str, ...],
                    weights: Weights) -> LoraConfig:
    """A run's adapter settings (`--lora_rank`, `--lora_alpha`, `--lora_dropout`, `--lora_targets`).

    They go on the base `weights` it loaded (`--init_from`), named as its checkpoints record it (`base_name`)."""
    return lora_config(rank, alpha, dropout, targets, base_name(weights), weights.revision)


def loadable_base(weights: Weights) -> tuple[str, str | None]:
    """How `final_adapter/` names its base (`base_model_name_or_path`, `revision`), for a loader with that folder only.

    peft's `AutoPeftModelForCausalLM` loads the base with transformers from those two. A Hub repo is its id at the
    commit the run downloaded. Local weights are the absolute path of the folder they were read from. For a run
    folder given as `--init_from`, that is its final/: transformers cannot load a run folder. The checkpoints keep
    `base_name`, the name a resume is checked against."""
    if weights.kind is Kind.HUB:
        return weights.spec, weights.commit or weights.revision
    return str(weights.folder.resolve()), None


def check_resume(config: LoraConfig | None, checkpoint: Path) -> None:
    """Refuse to resume a LoRA checkpoint as a full run (`config` None), or the reverse.

    Also refused: other LoRA settings (`config`, from `run_lora_config`) or another base."""
    saved_lora = (checkpoint / ADAPTER_CONFIG).is_file()
    if config is not None and not saved_lora:
        raise UserError(f"{checkpoint} is a checkpoint of a full fine-tune (every weight), not of a LoRA run; resume "
                        "it without --lora_rank, or start the LoRA run in a new --out_dir")
    if saved_lora and config is None:
        raise UserError(f"{checkpoint} is a checkpoint of a LoRA run (adapters only); resume it with the flags it was "
                        "trained with (--lora_rank, --lora_alpha, --lora_targets, --init_from its base)")
    if not saved_lora:
        return
    saved = read_adapter_config(checkpoint)
    fields = {"lora_rank": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
              "lora_targets": "target_modules", "init_from": "base_model_name_or_path"}
    diffs = [f"{flag}: checkpoint {getattr(saved, attr)!r} vs now {getattr(config, attr)!r}"
             for flag, attr in fields.items() if getattr(saved, attr) != getattr(config, attr)]
    if diffs:
        raise UserError(f"{checkpoint} was trained with other LoRA settings ({'; '.join(diffs)}); use the same "
                        "flags to resume")


def has_adapters(module: torch.nn.Module) -> bool:
    """Whether peft injected adapters into `module`."""
    return hasattr(module, "peft_config")
