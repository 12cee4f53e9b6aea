"""The training configuration: groups of fields owned by components, YAML presets, command-line overrides.

`python train.py --config configs/gpt2_124m_fineweb_edu.yaml --lr 3e-4` reads the preset, then applies the
flags; `python train.py configs/x.yaml` is the same as `--config configs/x.yaml`. Presets compose as in HF and
Hydra-style configs: `--config a.yaml --config b.yaml` applies a, then b over it, then the flags; a preset's own
`config:` key (a path or a list, read relative to the preset) includes presets before its values. Every preset
read is recorded, in the order applied, as `config` in the run's config.yaml. Parsing is
HfArgumentParser's over the groups of `configs.schema` and those a component adds for itself (an
optimizer's own flags: `configs.schema.add_group`). Every field becomes `--field`, also spelled `--fi-eld`, in the
style of every CLI here (`common.cli`): one-line errors with "did you mean", no prefix matching, defaults in
`--help`. A preset's values are converted to their fields' types when the preset is
read, so every group is built from typed values and checks them itself.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import os
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from common.cli import CliParser, suggest, unknown_arguments_message
from common.errors import UserError
from configs.schema import (
    GROUPS,
    DataConfig,
    EvalConfig,
    HubConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    PresetConfig,
    RunConfig,
    TrainConfig,
    TrainingConfig,
    all_groups,
    field_names,
    field_types,
)

__all__ = ["DataConfig", "EvalConfig", "HubConfig", "LogConfig", "ModelConfig", "OptimConfig", "PresetConfig",
           "RunConfig", "TrainConfig", "TrainingConfig", "parse_config", "read_run_config", "write_run_config"]

PRESETS_DIR = Path(__file__).resolve().parent
PRESET_FIELD = "config"  # `--config`, and a preset's key that includes other presets

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


def _hf_argument_parser() -> type:
    """transformers' HfArgumentParser, loaded from its own module file. That file needs only the standard library
    and PyYAML, while `from transformers import HfArgumentParser` first builds the whole package's lazy index: 0.8 s
    of every train.py start (each rank's, `--help`'s, a refused flag's; `python -X importtime`), more than the rest
    of the parse. Should a later transformers make the file import from its package, the package import is used."""
    package = importlib.util.find_spec("transformers")
    if package is not None and package.submodule_search_locations:
        spec = importlib.util.spec_from_file_location(
            "configs._hf_argparser", Path(package.submodule_search_locations[0]) / "hf_argparser.py")
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            return module.HfArgumentParser
        except ImportError:  # a relative import: the file no longer stands alone
            pass
    from transformers import HfArgumentParser

    return HfArgumentParser


_HfArgumentParser = _hf_argument_parser()


class _Parser(CliParser, _HfArgumentParser):
    """HfArgumentParser (every field is `--field` and `--fi-eld`, help from the field metadata) in the
    project's CLI style: one-line errors, no prefix matching, every default in `--help`."""

    @staticmethod
    def _parse_dataclass_field(parser: Any, field: dataclasses.Field) -> None:
        """HfArgumentParser passes a field's metadata to `add_argument`; its resume rule (`common.resume_rules`,
        which `training.recipe` reads) is not argparse's, so the field goes on without it. `--config` may be given
        several times: each one is kept, in order (HfArgumentParser would make a list field take several values
        after one flag, and a second flag replace the first)."""
        if field.name == PRESET_FIELD:
            parser.add_argument(f"--{field.name}", action="append", default=None, metavar="FILE",
                                help=field.metadata["help"])
            return
        if "resume" in field.metadata:
            field = copy.copy(field)
            field.metadata = types.MappingProxyType({k: v for k, v in field.metadata.items() if k != "resume"})
        _HfArgumentParser._parse_dataclass_field(parser, field)


def _config_parser() -> _Parser:
    return _Parser(list(all_groups().values()), prog="python train.py", aliases=FIELD_ALIASES,
                   description="Train a GPT; every flag is a field of one of configs.schema's groups. Presets "
                               "(--config FILE, repeatable, or FILE first) set fields in order; flags override "
                               "them.")


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


class _DuplicateKey(Exception):
    """A mapping key given twice in a preset, at lines `first` and `again` (1-based)."""

    def __init__(self, key: Any, first: int, again: int) -> None:
        super().__init__(key)
        self.key, self.first, self.again = key, first, again


class _PresetLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last value, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be set again, as YAML means
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(key, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


@dataclass(frozen=True)
class _Preset:
    """One preset file as this parse reached it: `path` as the user (or the including preset) named it, `file` where
    it is, and `by`, the preset that included it (None: given on the command line)."""

    path: str
    file: Path
    by: _Preset | None = None

    @property
    def named(self) -> str:
        """How a message names it: `--config a.yaml`, or `base.yaml (included by a.yaml)`."""
        return f"{self.path} (included by {self.by.path})" if self.by else f"--config {self.path}"

    def chain(self) -> list[_Preset]:
        """The presets that led here, this one last."""
        return (self.by.chain() if self.by else []) + [self]


def _given_preset(path: str) -> _Preset:
    """A preset named on the command line: the path, else the same name in configs/."""
    preset = Path(path).expanduser()
    if not preset.is_file() and (PRESETS_DIR / path).is_file():
        preset = PRESETS_DIR / path
    if not preset.is_file():
        raise UserError(f"--config {path}: no such file; presets live in {PRESETS_DIR}")
    return _Preset(path, preset)


def _included(by: _Preset, value: Any) -> list[_Preset]:
    """The presets a preset's `config:` key names (a path or a list of paths), each read relative to the preset."""
    paths = value if isinstance(value, list) else [value]
    if not paths or not all(isinstance(p, str) and p.strip() for p in paths):
        raise UserError(f"{by.named}: config: {value!r} is not a preset's path nor a list of them; fix that key in "
                        "the file")
    found = []
    for path in paths:
        file = by.file.parent / Path(path).expanduser()
        shown = os.path.normpath(Path(by.path).parent / path) if not Path(path).expanduser().is_absolute() else path
        if not file.is_file():
            raise UserError(f"{by.named}: config: {path}: no such file (an include is read relative to the preset's "
                            f"folder, {by.file.parent}); fix the path or remove the key")
        found.append(_Preset(shown, file, by))
    return found


def _read_mapping(preset: _Preset) -> dict[str, Any]:
    """A preset file's mapping, as written (one line for broken YAML, a key given twice, a non-mapping)."""
    try:
        values = yaml.load(preset.file.read_text(), Loader=_PresetLoader) or {}
    except _DuplicateKey as twice:
        raise UserError(f"{preset.named}: {twice.key} is given twice (lines {twice.first} and {twice.again}); keep "
                        "one") from None
    except yaml.YAMLError as err:
        raise UserError(f"{preset.named} is not valid YAML ({yaml_error_place(err)}); fix the file") from None
    if not isinstance(values, dict):
        raise UserError(f"{preset.named} must be a mapping of field: value")
    return values


def _read_presets(paths: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The values of the presets `paths`, applied in order (each preset's includes first, then its own values), each
    converted to its field's type; and every preset read, in the order applied. A preset reached a second time (two
    presets include the same base) is not applied again: it would undo what was set over it."""
    values: dict[str, Any] = {}
    read: dict[Path, str] = {}

    def apply(preset: _Preset) -> None:
        chain = preset.chain()
        if any(p.file.resolve() == preset.file.resolve() for p in chain[:-1]):
            first = next(p for p in chain if p.file.resolve() == preset.file.resolve())
            circle = " -> ".join(p.path for p in chain[chain.index(first):])
            raise UserError(f"{first.named}: its `config:` includes close a circle ({circle}); remove one of these "
                            "includes")
        if preset.file.resolve() in read:
            return
        own = _read_mapping(preset)
        if PRESET_FIELD in own:
            for included in _included(preset, own.pop(PRESET_FIELD)):
                apply(included)
        values.update(_typed_values(own, preset))
        read[preset.file.resolve()] = preset.path

    for path in paths:
        apply(_given_preset(path))
    return values, list(read.values())


def _typed_values(values: dict[Any, Any], preset: _Preset) -> dict[str, Any]:
    """A preset's values, each converted to its field's type."""
    names = field_names()
    unknown = sorted(set(values) - set(names), key=str)
    if unknown:
        hints = [f"{guess} for {name}, the flag --{guess}" for name in unknown
                 if (guess := suggest(str(name), names, FIELD_ALIASES)) is not None]
        raise UserError(f"{preset.named}: unknown field(s) {', '.join(map(str, unknown))}"
                        + (f" (did you mean {'; '.join(hints)}?)" if hints else "")
                        + "; see `python train.py --help`")
    types = field_types()
    typed = {}
    for name, value in values.items():
        try:
            typed[name] = _typed(types[name], value)
        except TypeError as err:  # the preset's mistake: named there, not as a flag the user never passed
            raise UserError(f"{preset.named}: {name}: {value!r} is not {err}; fix that key in the file") from None
    return typed


def _typed(hint: Any, value: Any) -> Any:
    """A preset value as its field's declared type (`hint`), exactly: a bool is never taken for a number, an int
    field accepts a float only when it is whole (YAML reads `1.0e+6` as a float), a float field any int,
    and a number written without a dot (`6e-4`, which PyYAML reads as a string) is read as one. A TypeError
    naming the type expected when the value is none of that."""
    options = typing.get_args(hint) or (hint,)  # `float | None` -> (float, NoneType)
    if value is None and type(None) in options:
        return None
    expected = next(t for t in options if t is not type(None))
    if isinstance(value, str) and expected in (int, float):
        try:
            value = expected(value)
        except ValueError:
            pass  # refused below, as a string
    if expected is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
        raise TypeError(f"{'an' if expected is int else 'a'} {expected.__name__}")
    return value


def _preset_first(argv: list[str]) -> list[str]:
    """`python train.py configs/x.yaml --lr 3e-4` (the nanoGPT habit) means `--config configs/x.yaml`; several
    presets given first are several `--config`s, in order, before any other `--config`."""
    first = 0
    while first < len(argv) and not argv[first].startswith("-"):
        if not argv[first].endswith((".yaml", ".yml")):
            raise UserError(f"unexpected argument {argv[first]!r}: a preset given first must be a .yaml file "
                            "(python train.py configs/shakespeare.yaml), and every other value follows its flag "
                            "(--max_steps 1000)")
        first += 1
    return [word for preset in argv[:first] for word in ("--config", preset)] + argv[first:]


# Other trainers' length in epochs (HF Trainer's --num_train_epochs, nanoGPT's and Keras' habits): train.py counts
# optimizer steps, and says what one epoch of the data is in steps (`_epochs_hint`).
EPOCH_FLAGS = {"num_train_epochs", "epochs", "num_epochs", "n_epochs", "max_epochs", "train_epochs"}


def _epochs_hint(flag: str, value: str | None, cfg: TrainConfig) -> str:
    """The line for `flag value` (an epoch count): --max_steps, and one epoch of the run's data in steps at its
    flags, counted by the loader the run would build (a streamed Hub dataset has no size ahead)."""
    from data.source import open_source

    line = f"{flag}{' ' + value if value else ''}: train.py counts optimizer steps, not epochs; pass --max_steps: "
    source, block, total = open_source(cfg.data), cfg.model.block_size, cfg.training.total_batch_size
    if not source.sized_ahead:
        return line + ("the size of a streamed Hub dataset is not known ahead (`python -m data.prepare` counts its "
                       "tokens: an epoch is those tokens / --total_batch_size steps)")
    loader = source.train_loader(block_size=block, micro_batch_size=1, rank=0, world_size=1, seed=cfg.training.seed)
    loader.close()
    rows, what = (loader.n_examples, "examples") if source.masked_targets else (loader.n_sequences, "windows")
    steps = math.ceil(rows / (total // block))  # a step reads total_batch_size / block_size rows
    line += f"one epoch of {cfg.data.dataset} is {steps:,} steps of {total:,} tokens ({rows:,} {what} of {block} " \
            "tokens)"
    try:
        return line + f", so {value} epochs is --max_steps {round(float(value) * steps)}"
    except (TypeError, ValueError):
        return line


# `accelerate launch` options people pass to train.py itself: the launch, not the script, decides them.
LAUNCH_FLAGS = {"mixed_precision", "num_processes", "dynamo_backend", "multi_gpu", "num_machines", "gpu_ids", "cpu",
                "fp16", "bf16", "use_fsdp", "main_process_port"}


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """The run's configuration from defaults, an optional preset (`--config`, or a .yaml file given first) and
    command-line flags; every group checked."""
    argv = _preset_first(sys.argv[1:] if argv is None else list(argv))
    parser = _config_parser()
    preset_args, _ = parser.parse_known_args(argv)
    presets_read = None
    if preset_args.config:
        values, presets_read = _read_presets(preset_args.config)
        parser.set_defaults(**values)
    *groups, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    launcher = [flag for flag in unknown if flag.split("=")[0].removeprefix("--").replace("-", "_") in LAUNCH_FLAGS]
    if launcher:
        raise UserError(f"{launcher[0].split('=')[0]} is accelerate's, not train.py's: precision, compile and the "
                        "number of processes come from the launch, e.g. `accelerate launch --mixed_precision bf16 "
                        "--num_processes 2 train.py ...` or `accelerate launch --config_file accelerate_configs/"
                        "single_gpu.yaml train.py ...`")
    own, added = dict(zip(GROUPS, groups[:len(GROUPS)])), groups[len(GROUPS):]
    own["preset"] = PresetConfig(presets_read)  # every preset read, includes too, as config.yaml records them

    def config() -> TrainConfig:
        return TrainConfig(**own, added=dict(zip(list(all_groups())[len(GROUPS):], added)))

    for i, word in enumerate(unknown):
        flag, _, value = word.partition("=")
        if flag.removeprefix("--").replace("-", "_") in EPOCH_FLAGS:
            given = value or (unknown[i + 1] if i + 1 < len(unknown) and not unknown[i + 1].startswith("-") else None)
            raise UserError(_epochs_hint(flag, given, config()))
    if unknown:
        parser.error(unknown_arguments_message(unknown, parser.option_names(), FIELD_ALIASES))
    return config()


def write_run_config(values: dict[str, Any], path: Path) -> None:
    """Record what a run ran with as YAML: the run folder's `config.yaml`, one key per flag (see
    `training.run_folder.recorded_config`), read back by `read_run_config`."""
    path.write_text(yaml.safe_dump(values, sort_keys=False))


def read_run_config(path: Path) -> dict[str, Any]:
    """The config a run recorded, as a dict (older runs may lack newer fields), or {} when there is none."""
    if not path.is_file():
        return {}
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML ({yaml_error_place(err)}); fix or remove it") from None
    return config if isinstance(config, dict) else {}
