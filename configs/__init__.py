"""The training configuration: one dataclass schema, YAML presets, command-line overrides.

`python train.py --config configs/gpt2_124m_fineweb_edu.yaml --lr 3e-4` reads the preset, then
applies the flags. Parsing is HfArgumentParser's (every field becomes `--field`); we only add the
preset layer and turn argparse's usage dumps into one-line errors.
"""
from __future__ import annotations

import math
import sys
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NoReturn

import yaml
from transformers import HfArgumentParser

from common.errors import UserError

PRESETS_DIR = Path(__file__).resolve().parent
REPORT_TO = ("none", "tensorboard", "wandb", "all")


@dataclass
class TrainConfig:
    """Every knob of a run. Defaults are the embedded Shakespeare run (`python train.py`)."""

    config: str | None = field(default=None, metadata={"help": "YAML preset; flags override it"})
    # Run folder and resumption
    out_dir: str = field(default="out/shakespeare", metadata={"help": "run folder (checkpoints, metrics, final/)"})
    resume: str | None = field(default=None, metadata={"help": "'latest' or a checkpoint folder"})
    # Model
    init_from: str = field(
        default="scratch",
        metadata={"help": "'scratch', a Hub id (gpt2...gpt2-xl), an HF folder or one of our runs; the architecture "
                          "flags (n_layer, n_head, n_embd, bias) then come from those weights"},
    )
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    dropout: float = 0.0
    bias: bool = True
    # Data
    dataset: str = field(
        default="shakespeare",
        metadata={"help": "'shakespeare', a local .txt/.jsonl/.parquet file/glob/folder, a shard folder, or a Hub id[:config]"},
    )
    text_column: str = "text"
    dataset_config: str | None = None
    val_tokens: int = field(default=8_192, metadata={"help": "size of the fixed validation set, in tokens"})
    # Batch: total_batch_size (tokens) = micro_batch_size * block_size * processes * accumulation
    total_batch_size: int = 2048
    micro_batch_size: int = 8
    max_steps: int = 150
    # Optimizer and schedule: linear warmup, then cosine decay to lr * min_lr_ratio
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 15
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    on_nan: str = field(default="stop", metadata={"help": "'stop' (keep the last good checkpoint) or 'skip' the step"})
    max_nan_skips: int = field(default=10,
                               metadata={"help": "with --on_nan skip: stop after this many skipped steps in a row"})
    seed: int = 1337
    # Evaluation, sampling, logging
    log_every: int = 10
    eval_every: int = 50
    eval_batch_size: int = 16
    hellaswag_every: int = field(default=0, metadata={"help": "0 = never; needs the eval package"})
    hellaswag_data: str | None = field(default=None, metadata={"help": "local HellaSwag jsonl; default: the Hub split"})
    hellaswag_limit: int | None = None
    sample_tokens: int = 64
    sample_prompt: str = "\n"
    report_to: str = field(default="none", metadata={"help": "'none', 'tensorboard', 'wandb', or 'all'"})
    wandb_project: str = "gpt2-accelerate"
    run_name: str | None = None
    # Checkpoints and publishing
    save_every: int = 100
    keep_last: int = 3
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_push_every: int = field(default=0, metadata={"help": "also push every K-th checkpoint to branch step-N; 0 = never"})
    mfu_peak_flops: float | None = field(default=None, metadata={"help": "override the accelerator's bf16 peak FLOP/s"})


class _Parser(HfArgumentParser):
    """HfArgumentParser whose errors are one line, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; see `python train.py --help` for the fields")


def _load_preset(path: str) -> dict[str, Any]:
    preset = Path(path)
    if not preset.is_file() and (PRESETS_DIR / path).is_file():
        preset = PRESETS_DIR / path
    if not preset.is_file():
        raise UserError(f"--config {path}: no such file; presets live in {PRESETS_DIR}")
    try:
        values = yaml.safe_load(preset.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"--config {path} is not valid YAML ({err.__class__.__name__}); fix the file") from None
    if not isinstance(values, dict):
        raise UserError(f"--config {path} must be a mapping of field: value")
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(f"--config {path}: unknown field(s) {', '.join(unknown)}; see `python train.py --help`")
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


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Build the config from defaults, an optional `--config` preset, and command-line flags."""
    argv = sys.argv[1:] if argv is None else argv
    parser = _Parser(TrainConfig)
    preset_args, _ = parser.parse_known_args(argv)
    if preset_args.config:
        parser.set_defaults(**_load_preset(preset_args.config))
    cfg, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        raise UserError(f"unknown argument(s) {' '.join(unknown)}; see `python train.py --help` for the fields")
    _check_types(cfg)
    _check_values(cfg)
    return cfg


_POSITIVE = ("n_layer", "n_head", "n_embd", "block_size", "total_batch_size", "micro_batch_size", "max_steps",
             "log_every", "eval_every", "eval_batch_size", "save_every", "keep_last", "val_tokens", "max_nan_skips")
_NON_NEGATIVE = ("warmup_steps", "hellaswag_every", "sample_tokens", "hub_push_every")
_NON_EMPTY = ("out_dir", "init_from", "dataset", "text_column", "wandb_project")
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
        raise UserError(f"--min_lr_ratio must be in [0, 1] (the final LR is lr * min_lr_ratio), got {cfg.min_lr_ratio}; "
                        "use e.g. 0.1")
    if cfg.weight_decay < 0:
        raise UserError(f"--weight_decay must be 0 or more, got {cfg.weight_decay}; use e.g. 0.1, or 0 for none")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise UserError(f"--{name} must be in [0, 1), got {getattr(cfg, name)}; use e.g. 0.9 (beta1) or 0.95 (beta2)")
    if not cfg.grad_clip > 0:
        raise UserError(f"--grad_clip must be positive (the max gradient norm), got {cfg.grad_clip}; use e.g. 1.0")
    if not 0 <= cfg.seed <= _MAX_SEED:
        raise UserError(f"--seed must be in [0, {_MAX_SEED}], got {cfg.seed}")
    if cfg.hellaswag_limit is not None and cfg.hellaswag_limit < 1:
        raise UserError(f"--hellaswag_limit must be at least 1, got {cfg.hellaswag_limit}; leave it out to score "
                        "every item")
    if cfg.mfu_peak_flops is not None and not cfg.mfu_peak_flops > 0:
        raise UserError(f"--mfu_peak_flops must be positive (FLOP/s, e.g. 989e12 for an H100), got {cfg.mfu_peak_flops}; "
                        "leave it out to use the accelerator's own")
    if not cfg.sample_prompt:
        raise UserError("sample_prompt is empty; pass at least one character, e.g. --sample_prompt '\\n' (the default)")
    if cfg.on_nan not in ("stop", "skip"):
        raise UserError(f"on_nan must be 'stop' or 'skip', got {cfg.on_nan!r}")
    if cfg.report_to not in REPORT_TO:
        raise UserError(f"report_to must be one of {', '.join(REPORT_TO)}, got {cfg.report_to!r}")
    if cfg.push_to_hub and not cfg.hub_model_id:
        raise UserError("--push_to_hub needs --hub_model_id user/name")
    _check_paths(cfg)


def _check_paths(cfg: TrainConfig) -> None:
    """Paths of the wrong kind, as far as the local filesystem tells (Hub ids are left to their loaders)."""
    out_dir = Path(cfg.out_dir).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out_dir {cfg.out_dir} is an existing file, not a folder; choose another --out_dir")
    if cfg.resume is not None and cfg.resume != "latest":
        resume = Path(cfg.resume).expanduser()
        if resume.is_file():
            raise UserError(f"--resume {cfg.resume} is a file; pass 'latest', a checkpoints/step_* folder or a run folder")
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
        raise UserError(f"{path} is not valid YAML ({err.__class__.__name__}); fix or remove it") from None
    return config if isinstance(config, dict) else {}
