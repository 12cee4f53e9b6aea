"""The training configuration: one dataclass schema, YAML presets, command-line overrides.

`python train.py --config configs/gpt2_124m_fineweb_edu.yaml --lr 3e-4` reads the preset, then
applies the flags; `python train.py configs/x.yaml` is the same as `--config configs/x.yaml`. Parsing
is HfArgumentParser's (every field becomes `--field`, also spelled `--fi-eld`) in the style of every
CLI here (`common.cli`): one-line errors with "did you mean", no prefix matching, defaults in `--help`.
"""
from __future__ import annotations

import math
import sys
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser

from common.cli import CliParser, suggest, unknown_arguments_message
from common.errors import UserError

PRESETS_DIR = Path(__file__).resolve().parent
REPORT_TO = ("none", "tensorboard", "wandb", "all")
OPTIMIZERS = ("adamw", "muon")


def _field(default: Any, help: str) -> Any:
    """A config field with its `--help` text (HfArgumentParser reads it from the field's metadata)."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    """Every knob of a run. Defaults are the embedded Shakespeare run (`python train.py`).

    Every field has a help text: `python train.py --help` prints it with the default. A default of None
    must say in its help what None means (`tests/test_cli.py` checks both)."""

    config: str | None = _field(None, "YAML preset, e.g. configs/shakespeare.yaml (or given first, without "
                                      "--config); flags override it; default: none, the values below")
    # Run folder and resumption
    out_dir: str = _field("out/shakespeare", "run folder (checkpoints, metrics, final/)")
    resume: str | None = _field(None, "'latest' or a checkpoint folder; default: start a new run")
    # Model
    init_from: str = _field("scratch", "'scratch', a Hub id (gpt2...gpt2-xl), an HF folder or one of our runs; "
                                       "the architecture flags (n_layer, n_head, n_embd, bias) then come from "
                                       "those weights")
    n_layer: int = _field(4, "transformer blocks (with --init_from scratch)")
    n_head: int = _field(4, "attention heads per block; must divide n_embd")
    n_embd: int = _field(128, "embedding width")
    block_size: int = _field(128, "context length in tokens (training windows and the model's positions)")
    dropout: float = _field(0.0, "dropout probability while training, in [0, 1)")
    bias: bool = _field(True, "biases in the linear layers and LayerNorms, as GPT-2 (--no_bias: none)")
    # LoRA (through peft): only the adapters train and are checkpointed; final/ is the merged model
    lora_rank: int = _field(0, "LoRA rank r; 0 = full fine-tuning (every weight trains); needs --init_from")
    lora_alpha: float = _field(16.0, "LoRA scaling: the adapter adds B A x lora_alpha / lora_rank")
    lora_dropout: float = _field(0.0, "dropout on the adapters' input while training, in [0, 1)")
    lora_targets: str = _field("c_attn,c_proj,c_fc", "comma-separated layers that get adapters: the attention "
                                                      "(c_attn, attn.c_proj) and MLP (c_fc, mlp.c_proj) projections")
    # Data
    dataset: str = _field("shakespeare", "'shakespeare', a local .txt/.jsonl/.parquet file/glob/folder, a shard "
                                         "folder, or a Hub id[:config]")
    text_column: str = _field("text", "column holding the text in .jsonl/.parquet files and Hub datasets")
    prompt_field: str = _field("prompt", "prompt field of prompt/completion .jsonl data (a .jsonl whose first record "
                                         "has it and --completion_field; the loss counts only completion tokens)")
    completion_field: str = _field("completion", "completion field of prompt/completion .jsonl data")
    dataset_config: str | None = _field(None, "Hub dataset config name; default: the one given after ':' in "
                                              "--dataset, or the dataset's default")
    val_tokens: int = _field(8_192, "size of the fixed validation set, in tokens")
    # Batch: total_batch_size (tokens) = micro_batch_size * block_size * processes * accumulation
    total_batch_size: int = _field(2048, "tokens per optimizer step; gradient accumulation = total_batch_size / "
                                         "(micro_batch_size x block_size x processes)")
    micro_batch_size: int = _field(8, "sequences per forward pass on each process")
    max_steps: int = _field(100, "optimizer steps of the whole run")
    # Optimizer and schedule: linear warmup, then cosine decay to lr * min_lr_ratio
    lr: float = _field(1e-2, "peak learning rate of AdamW (with Muon: of the embeddings/output layer, biases and "
                                   "LayerNorms), reached after --warmup_steps; AdamW alone from scratch: ~1e-3; "
                                   "fine-tuning: e.g. 6e-5")
    min_lr_ratio: float = _field(0.1, "the cosine decay ends at lr x min_lr_ratio, at --max_steps")
    warmup_steps: int = _field(10, "steps of linear warmup from lr / warmup_steps to lr")
    weight_decay: float = _field(0.1, "AdamW weight decay, on weights of 2 or more dimensions (matrices, embeddings)")
    beta1: float = _field(0.9, "AdamW beta1")
    beta2: float = _field(0.95, "AdamW beta2")
    optimizer: str = _field("auto", "'muon' (torch.optim.Muon on the blocks' 2-D weights, AdamW with --lr on "
                                    "embeddings/output layer, biases and LayerNorms), 'adamw' (every parameter), or "
                                    "'auto': muon with --init_from scratch, adamw to fine-tune pretrained weights")
    muon_lr: float = _field(0.02, "Muon's peak learning rate (--optimizer muon); same warmup and decay as --lr")
    muon_momentum: float = _field(0.95, "Muon's momentum (Nesterov)")
    muon_weight_decay: float = _field(0.0, "Muon's decoupled weight decay (each step w -= lr x wd x w)")
    grad_clip: float = _field(1.0, "clip the global gradient norm to this")
    on_nan: str = _field("stop", "'stop' (keep the last good checkpoint) or 'skip' the step")
    max_nan_skips: int = _field(10, "with --on_nan skip: stop after this many skipped steps in a row")
    seed: int = _field(1337, "seed of the initial weights, data order, dropout and samples")
    # Evaluation, sampling, logging
    log_every: int = _field(10, "log a line (loss, lr, grad norm, tokens/s, MFU, ETA) every N steps")
    eval_every: int = _field(50, "validation loss and a sample every N steps (and at the last)")
    eval_batch_size: int = _field(16, "sequences (validation) or HellaSwag items per evaluation forward pass")
    hellaswag_every: int = _field(0, "HellaSwag every N steps; 0 = never; needs the eval package")
    hellaswag_data: str | None = _field(None, "local HellaSwag jsonl; default: the Hub split")
    hellaswag_limit: int | None = _field(None, "score only the first N HellaSwag items; default: all 10,042")
    sample_tokens: int = _field(64, "tokens of the text sample printed at each evaluation; 0 = no sample")
    sample_prompt: str = _field("\n", "prompt of that sample")
    report_to: str = _field("none", "'none', 'tensorboard', 'wandb', or 'all'")
    wandb_project: str = _field("gpt2-accelerate", "wandb project (with --report_to wandb)")
    run_name: str | None = _field(None, "run name for the trackers; default: the --out_dir folder's name")
    # Checkpoints and publishing
    save_every: int = _field(100, "checkpoint every N steps (and at the last, and on SIGTERM/SIGUSR1)")
    keep_last: int = _field(3, "checkpoints kept; older ones are deleted")
    push_to_hub: bool = _field(False, "push final/ to the Hub at the end (needs --hub_model_id)")
    hub_model_id: str | None = _field(None, "Hub repo to push to, user/name; default: none")
    hub_push_every: int = _field(0, "also push every K-th checkpoint to branch step-N; 0 = never")
    mfu_peak_flops: float | None = _field(None, "bf16 peak FLOP/s per device for MFU; default: the "
                                                "accelerator's if known (none on CPU or an unlisted GPU: no MFU)")

    def __post_init__(self) -> None:
        # --optimizer auto: Muon to train from scratch (tuned and measured here: docs/benchmarks.md); AdamW to
        # fine-tune weights that AdamW trained, and for LoRA adapters (low-rank factors, not hidden matrices).
        if self.optimizer == "auto":
            self.optimizer = "muon" if self.init_from == "scratch" else "adamw"


# Names other trainers (HF Trainer, nanoGPT, Megatron, ...) use for our fields: `--learning_rate` gets
# "did you mean --lr?" rather than a bare "unknown argument".
FIELD_ALIASES = {
    "learning_rate": "lr", "max_lr": "lr", "min_lr": "min_lr_ratio",
    "batch_size": "micro_batch_size", "per_device_train_batch_size": "micro_batch_size",
    "train_batch_size": "micro_batch_size", "gradient_accumulation_steps": "total_batch_size",
    "per_device_eval_batch_size": "eval_batch_size",
    "max_iters": "max_steps", "max_train_steps": "max_steps", "num_train_steps": "max_steps",
    "warmup_iters": "warmup_steps", "lr_warmup_steps": "warmup_steps",
    "adam_beta1": "beta1", "adam_beta2": "beta2", "max_grad_norm": "grad_clip", "clip_grad": "grad_clip",
    "output_dir": "out_dir", "resume_from_checkpoint": "resume", "model_name_or_path": "init_from",
    "context_length": "block_size", "seq_len": "block_size", "n_positions": "block_size",
    "num_layers": "n_layer", "n_layers": "n_layer", "num_heads": "n_head", "n_heads": "n_head",
    "hidden_size": "n_embd", "d_model": "n_embd",
    "log_interval": "log_every", "logging_steps": "log_every", "eval_interval": "eval_every",
    "eval_steps": "eval_every", "save_steps": "save_every", "save_total_limit": "keep_last",
    "dataset_name": "dataset", "dataset_config_name": "dataset_config", "wandb_log": "report_to",
}
FIELD_NAMES = [f.name for f in fields(TrainConfig)]


class _Parser(CliParser, HfArgumentParser):
    """HfArgumentParser (every field is `--field` and `--fi-eld`, help from the field metadata) in the
    project's CLI style: one-line errors, no prefix matching, every default in `--help`."""


def _config_parser() -> _Parser:
    return _Parser(TrainConfig, prog="python train.py", aliases=FIELD_ALIASES,
                   description="Train a GPT; every flag is a field of configs.TrainConfig. A preset "
                               "(--config FILE, or FILE first) sets fields, flags override it.")


def yaml_error_place(err: yaml.YAMLError) -> str:
    """Where and what PyYAML found wrong, e.g. `line 3, column 1: could not find expected ':' (while
    scanning a simple key at line 2, column 1)`; the context often points at the real mistake."""

    def at(mark: Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    mark, context_mark = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
    message = getattr(err, "problem", None) or err.__class__.__name__
    if mark is not None:
        message = f"{at(mark)}: {message}"
    if getattr(err, "context", None) and context_mark is not None:
        message += f" ({err.context} at {at(context_mark)})"
    return message


def _load_preset(path: str) -> dict[str, Any]:
    preset = Path(path)
    if not preset.is_file() and (PRESETS_DIR / path).is_file():
        preset = PRESETS_DIR / path
    if not preset.is_file():
        raise UserError(f"--config {path}: no such file; presets live in {PRESETS_DIR}")
    try:
        values = yaml.safe_load(preset.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"--config {path} is not valid YAML ({yaml_error_place(err)}); fix the file") from None
    if not isinstance(values, dict):
        raise UserError(f"--config {path} must be a mapping of field: value")
    unknown = sorted(set(values) - set(FIELD_NAMES))
    if unknown:
        hints = [f"{name} -> {guess}" for name in unknown
                 if (guess := suggest(str(name), FIELD_NAMES, FIELD_ALIASES)) is not None]
        raise UserError(f"--config {path}: unknown field(s) {', '.join(map(str, unknown))}"
                        + (f" (did you mean {', '.join(hints)}?)" if hints else "")
                        + "; see `python train.py --help`")
    return values


_FIELD_TYPES = typing.get_type_hints(TrainConfig)
_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}


def _check_types(cfg: TrainConfig) -> None:
    """Preset values bypass argparse's conversion: coerce and check them against the schema.

    After it, every field holds its declared type exactly: a bool is never taken for a number, an int field
    accepts a float only when it is whole (YAML reads `1.0e+6` as a float), a float field any int."""
    for name, hint in _FIELD_TYPES.items():
        value = getattr(cfg, name)
        options = typing.get_args(hint) or (hint,)  # `float | None` -> (float, NoneType)
        if value is None and type(None) in options:
            continue
        expected = next(t for t in options if t is not type(None))
        if isinstance(value, str) and expected in (int, float):
            try:  # PyYAML reads `6e-4` (no dot) as a string
                value = expected(value)
            except ValueError:
                pass
        if expected is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
            raise UserError(f"--{name} must be {expected.__name__}, got {value!r}; fix the preset or the flag")
        setattr(cfg, name, value)


def _preset_first(argv: list[str]) -> list[str]:
    """`python train.py configs/x.yaml --lr 3e-4` (the nanoGPT habit) means `--config configs/x.yaml`."""
    if not argv or argv[0].startswith("-"):
        return argv
    if not argv[0].endswith((".yaml", ".yml")):
        raise UserError(f"unexpected argument {argv[0]!r}: a preset given first must be a .yaml file "
                        "(python train.py configs/shakespeare.yaml), and every other value follows its --flag")
    if any(a == "--config" or a.startswith("--config=") for a in argv[1:]):
        raise UserError(f"two presets: {argv[0]} and --config; pass one")
    return ["--config", *argv]


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Build the config from defaults, an optional preset (`--config`, or a .yaml file given first), and
    command-line flags."""
    argv = _preset_first(sys.argv[1:] if argv is None else list(argv))
    parser = _config_parser()
    preset_args, _ = parser.parse_known_args(argv)
    if preset_args.config:
        parser.set_defaults(**_load_preset(preset_args.config))
    cfg, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        parser.error(unknown_arguments_message(unknown, parser.option_names(), FIELD_ALIASES))
    _check_types(cfg)
    _check_values(cfg)
    return cfg


_POSITIVE = ("n_layer", "n_head", "n_embd", "block_size", "total_batch_size", "micro_batch_size", "max_steps",
             "log_every", "eval_every", "eval_batch_size", "save_every", "keep_last", "val_tokens", "max_nan_skips")
_NON_NEGATIVE = ("warmup_steps", "hellaswag_every", "sample_tokens", "hub_push_every")
_NON_EMPTY = ("out_dir", "init_from", "dataset", "text_column", "prompt_field", "completion_field", "wandb_project")
_MAX_SEED = 2**32 - 1  # numpy's seed range (accelerate's set_seed seeds numpy too)


def _looks_like_path(value: str) -> bool:
    """A value written as a filesystem path (not a Hub id, not a keyword)."""
    return value.startswith(("/", "./", "../", "~")) or value in (".", "..")


def _check_values(cfg: TrainConfig) -> None:
    """Ranges and kinds of every field, checked before anything is created; each error names the flag, the
    value and the fix. Paths are only judged where that needs no network (an existing file where a folder
    is expected, a missing local path)."""
    for name in _POSITIVE:
        if getattr(cfg, name) <= 0:
            raise UserError(f"--{name} must be positive, got {getattr(cfg, name)}; pass a value of at least 1")
    for name in _NON_NEGATIVE:
        if getattr(cfg, name) < 0:
            raise UserError(f"--{name} must be 0 or more, got {getattr(cfg, name)}; pass 0 to turn it off")
    for name in _NON_EMPTY:
        if not getattr(cfg, name).strip():
            raise UserError(f"--{name} is empty; pass a value (default: {_DEFAULTS[name]!r})")
    for name in ("dataset_config", "run_name", "hub_model_id", "resume", "hellaswag_data", "config"):
        if getattr(cfg, name) is not None and not getattr(cfg, name).strip():
            raise UserError(f"--{name} is empty; pass a value or leave the flag out")
    for name, hint in _FIELD_TYPES.items():
        value = getattr(cfg, name)
        if float in (typing.get_args(hint) or (hint,)) and value is not None and not math.isfinite(value):
            raise UserError(f"--{name} must be a finite number, got {value}")
    if cfg.n_embd % cfg.n_head:
        raise UserError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
    if cfg.val_tokens < cfg.block_size + 1:
        raise UserError(f"--val_tokens {cfg.val_tokens} is less than one validation window (block_size + 1 = "
                        f"{cfg.block_size + 1}); pass --val_tokens {cfg.block_size + 1} or more")
    if not 0.0 <= cfg.dropout < 1.0:
        raise UserError(f"dropout must be in [0, 1), got {cfg.dropout}; use e.g. 0.0 or 0.1")
    if not cfg.lr > 0:
        raise UserError(f"--lr must be positive, got {cfg.lr}; use e.g. 6e-4")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise UserError(f"--min_lr_ratio must be in [0, 1] (the final LR is lr * min_lr_ratio), "
                        f"got {cfg.min_lr_ratio}; "
                        "use e.g. 0.1")
    if cfg.weight_decay < 0:
        raise UserError(f"--weight_decay must be 0 or more, got {cfg.weight_decay}; use e.g. 0.1, or 0 for none")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise UserError(f"--{name} must be in [0, 1), got {getattr(cfg, name)}; "
                            "use e.g. 0.9 (beta1) or 0.95 (beta2)")
    if cfg.optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer must be one of auto, {', '.join(OPTIMIZERS)}, got {cfg.optimizer!r}")
    if not cfg.muon_lr > 0:
        raise UserError(f"--muon_lr must be positive, got {cfg.muon_lr}; use e.g. 0.02")
    if not 0.0 <= cfg.muon_momentum < 1.0:
        raise UserError(f"--muon_momentum must be in [0, 1), got {cfg.muon_momentum}; use e.g. 0.95")
    if cfg.muon_weight_decay < 0:
        raise UserError(f"--muon_weight_decay must be 0 or more, got {cfg.muon_weight_decay}; use e.g. 0 or 0.01")
    if not cfg.grad_clip > 0:
        raise UserError(f"--grad_clip must be positive (the max gradient norm), got {cfg.grad_clip}; use e.g. 1.0")
    if not 0 <= cfg.seed <= _MAX_SEED:
        raise UserError(f"--seed must be in [0, {_MAX_SEED}], got {cfg.seed}")
    if cfg.hellaswag_limit is not None and cfg.hellaswag_limit < 1:
        raise UserError(f"--hellaswag_limit must be at least 1, got {cfg.hellaswag_limit}; leave it out to score "
                        "every item")
    if cfg.mfu_peak_flops is not None and not cfg.mfu_peak_flops > 0:
        raise UserError(f"--mfu_peak_flops must be positive (FLOP/s, e.g. 989e12 for an H100), "
                        f"got {cfg.mfu_peak_flops}; "
                        "leave it out to use the accelerator's own")
    if not cfg.sample_prompt:
        raise UserError("sample_prompt is empty; pass at least one character, e.g. --sample_prompt '\\n' (the default)")
    if cfg.on_nan not in ("stop", "skip"):
        raise UserError(f"on_nan must be 'stop' or 'skip', got {cfg.on_nan!r}")
    if cfg.report_to not in REPORT_TO:
        raise UserError(f"report_to must be one of {', '.join(REPORT_TO)}, got {cfg.report_to!r}")
    _check_lora(cfg)
    if cfg.push_to_hub and not cfg.hub_model_id:
        raise UserError("--push_to_hub needs --hub_model_id user/name")
    _check_paths(cfg)


def _check_lora(cfg: TrainConfig) -> None:
    """The LoRA flags as far as they can be judged without the model (rank vs layer sizes: `model.lora`)."""
    if cfg.lora_rank < 0:
        raise UserError(f"--lora_rank must be 0 (full fine-tuning) or a rank of at least 1, got {cfg.lora_rank}; "
                        "use e.g. 8")
    if not cfg.lora_rank:
        return
    if cfg.init_from == "scratch":
        raise UserError("--lora_rank trains adapters on pretrained weights, but --init_from is 'scratch'; pass "
                        "--init_from (a Hub id such as gpt2, an HF folder or a run folder)")
    if cfg.optimizer != "adamw":
        raise UserError(f"--lora_rank trains its adapters with AdamW only (Muon orthogonalises whole hidden matrices, "
                        f"not rank-{cfg.lora_rank} factors); drop --optimizer {cfg.optimizer} or --lora_rank")
    if not cfg.lora_alpha > 0:
        raise UserError(f"--lora_alpha must be positive, got {cfg.lora_alpha}; use e.g. 2 x --lora_rank")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise UserError(f"--lora_dropout must be in [0, 1), got {cfg.lora_dropout}; use e.g. 0.0 or 0.05")
    if not all(t.strip() for t in cfg.lora_targets.split(",")):
        raise UserError(f"--lora_targets {cfg.lora_targets!r} has an empty name; pass comma-separated layer names, "
                        "e.g. c_attn,c_proj,c_fc")


def _check_paths(cfg: TrainConfig) -> None:
    """Paths of the wrong kind, as far as the local filesystem tells (Hub ids are left to their loaders)."""
    out_dir = Path(cfg.out_dir).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out_dir {cfg.out_dir} is an existing file, not a folder; choose another --out_dir")
    if cfg.resume is not None and cfg.resume != "latest":
        resume = Path(cfg.resume).expanduser()
        if resume.is_file():
            raise UserError(f"--resume {cfg.resume} is a file; pass 'latest', a checkpoints/step_* folder or a run "
                            "folder")
        if not resume.exists():
            raise UserError(f"--resume {cfg.resume}: no such folder; pass 'latest', a checkpoints/step_* folder or a "
                            "run folder")
    init_from = Path(cfg.init_from).expanduser()
    if init_from.is_file():
        raise UserError(f"--init_from {cfg.init_from} is a file; pass 'scratch', a Hub id (e.g. gpt2), an HF model "
                        "folder or a run folder")
    if _looks_like_path(cfg.init_from) and not init_from.exists():
        raise UserError(f"--init_from {cfg.init_from}: no such folder; pass an existing HF model folder or run folder, "
                        "or a Hub id (e.g. gpt2)")
    if cfg.hellaswag_data is not None and not Path(cfg.hellaswag_data).expanduser().is_file():
        kind = "a folder" if Path(cfg.hellaswag_data).expanduser().is_dir() else "not an existing file"
        raise UserError(f"--hellaswag_data {cfg.hellaswag_data} is {kind}; pass a HellaSwag .jsonl or .jsonl.gz "
                        "file, or leave it out to use the Hub copy")


def write_run_config(cfg: TrainConfig, path: Path) -> None:
    """Record the run's config as YAML (the run folder's `config.yaml`, read back by `read_run_config`)."""
    path.write_text(yaml.safe_dump(asdict(cfg), sort_keys=False))


def read_run_config(path: Path) -> dict[str, Any]:
    """The config a run recorded, as a dict (older runs may lack newer fields), or {} when there is none."""
    if not path.is_file():
        return {}
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML ({yaml_error_place(err)}); fix or remove it") from None
    return config if isinstance(config, dict) else {}
