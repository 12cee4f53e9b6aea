"""The training configuration, one group of fields per component that uses it (the data group, which
`data.prepare` and `eval.val_loss` use too, is data's own: `data.settings.DataConfig`).

Each group is a dataclass whose fields are train.py flags (names, defaults and help texts are the command
line, the presets and `config.yaml`: a contract). Each group checks its own values when it is built, so a
bad value is one `UserError` line naming the flag and the fix, before anything is created. `TrainConfig`
holds the groups and the rules that join two of them; a component receives its group, never the whole.

Defaults are the embedded Shakespeare run (`python train.py`). A default of None says in its help what
None means (`tests/test_cli.py` checks every field's help).
"""
from __future__ import annotations

import functools
import math
import typing
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any

from common.errors import UserError
from common.parallelism import DEGREES, Degree
from common.resume_rules import ACCEPTED, CHECKED, NOT_COMPARED, RESTORED, SCHEDULE, Refused, flag, resume_rule
from data.settings import DataConfig, check_val_tokens

REPORT_TO = ("none", "tensorboard", "wandb", "trackio", "all")  # training.metrics.TRACKERS: what each starts
ON_NAN = ("stop", "skip")
MAX_SEED = 2**32 - 1  # numpy's seed range (accelerate's set_seed seeds numpy too)
# --val_tokens as shipped: a validation cap left at it leaves the block size as what a too-long window changed
DEFAULT_VAL_TOKENS = next(f.default for f in fields(DataConfig) if f.name == "val_tokens")
# --collective_timeout's default: GPT-2 1.5B's checkpoint (1.56e9 parameters x 16 bytes = 25 GB) is written, then read
# back for its manifest's hashes, while the other processes wait in a barrier: 50 GB at 30 MB/s, a slow shared
# filesystem, is 28 minutes. (torch's defaults: 30 minutes on gloo, 10 on NCCL.)
COLLECTIVE_TIMEOUT_S = 1800



def _positive(group: Any, *names: str) -> None:
    for name in names:
        if getattr(group, name) <= 0:
            raise UserError(f"--{name} must be positive, got {getattr(group, name)}; pass a value of at least 1")


def _non_negative(group: Any, *names: str) -> None:
    for name in names:
        if getattr(group, name) < 0:
            raise UserError(f"--{name} must be 0 or more, got {getattr(group, name)}; pass 0 to turn it off")


def _non_empty(group: Any, *names: str) -> None:
    """Required text fields must hold text; optional ones (None = left out) must not be blank when given."""
    for name in names:
        value = getattr(group, name)
        if value is not None and not value.strip():
            default = next(f.default for f in fields(group) if f.name == name)
            raise UserError(f"--{name} is empty; pass a value (default: {default!r})" if default is not None
                            else f"--{name} is empty; pass a value or leave the flag out")


def _finite(group: Any) -> None:
    for f in fields(group):
        value = getattr(group, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"--{f.name} must be a finite number, got {value}")


def _looks_like_path(value: str) -> bool:
    """A value written as a filesystem path (not a Hub id, not a keyword)."""
    return value.startswith(("/", "./", "../", "~")) or value in (".", "..")


@dataclass
class RunConfig:
    """The run folder and its checkpoints (training.checkpoints.checkpoint, training.run_folder)."""

    _argument_group_name = "run folder and checkpoints"

    out_dir: str = flag("out/shakespeare", "run folder (checkpoints, metrics, final/)", NOT_COMPARED)
    resume: str | None = flag(None, "'latest' or a checkpoint folder; default: start a new run", NOT_COMPARED)
    save_every: int = flag(100, "checkpoint every N steps (and at the last, and on SIGTERM/SIGUSR1)", ACCEPTED)
    keep_last: int = flag(3, "checkpoints kept; older ones are deleted", ACCEPTED)
    collective_timeout: int = flag(
        COLLECTIVE_TIMEOUT_S, "seconds a process waits for the others in a collective before the run ends with a "
        "line naming the step, the process(es) that did not answer and the last checkpoint (a hung process); 1800 "
        "lets the largest preset's checkpoint (GPT-2 1.5B: 25 GB with its optimizer state) be written and hashed at "
        "30 MB/s while the others wait", NOT_COMPARED)
    plan: bool = flag(False, "print this config's per-device memory plan (computed from the shapes, not "
                             "measured) for the accelerate launch, and exit before anything is built", NOT_COMPARED)

    def __post_init__(self) -> None:
        _positive(self, "save_every", "keep_last", "collective_timeout")
        _non_empty(self, "out_dir", "resume")
        out_dir = Path(self.out_dir).expanduser()
        if out_dir.exists() and not out_dir.is_dir():
            raise UserError(f"--out_dir {self.out_dir} is an existing file, not a folder; choose another --out_dir")
        if self.resume is not None and self.resume != "latest":
            resume = Path(self.resume).expanduser()
            if resume.is_file():
                raise UserError(f"--resume {self.resume} is a file; pass 'latest', a checkpoints/step_* folder or a "
                                "run folder")
            if not resume.exists():
                from common.run_dir import kept_instead  # here: it imports accelerate, which a parse need not

                if (kept := kept_instead(resume)) is not None:
                    raise UserError(f"--resume {self.resume}: no such checkpoint: {kept}; pass one of those, or "
                                    "'latest'")
                raise UserError(f"--resume {self.resume}: no such folder; pass 'latest', a checkpoints/step_* folder "
                                "or a run folder")


@dataclass
class ModelConfig:
    """The network: its architecture (or the weights it starts from) and LoRA adapters (training.network)."""

    _argument_group_name = "model"

    init_from: str = flag("scratch", "'scratch', a Hub id (gpt2...gpt2-xl), an HF folder or one of our runs; "
                                     "the architecture flags (n_layer, n_head, n_embd, bias) then come from "
                                     "those weights", Refused("the weights the run started from"))
    n_layer: int = flag(6, "transformer blocks (with --init_from scratch)", CHECKED)
    n_head: int = flag(4, "attention heads per block; must divide n_embd", CHECKED)
    n_embd: int = flag(48, "embedding width", CHECKED)
    block_size: int = flag(128, "context length in tokens (training windows and the model's positions)", CHECKED)
    dropout: float = flag(0.0, "dropout probability while training, in [0, 1)", CHECKED)
    bias: bool = flag(True, "biases in the linear layers and LayerNorms, as GPT-2 (--no_bias: none)", CHECKED)
    # LoRA (through peft): only the adapters train and are checkpointed; final/ is the merged model
    lora_rank: int = flag(0, "LoRA rank r; 0 = full fine-tuning (every weight trains); needs --init_from", CHECKED)
    lora_alpha: float = flag(16.0, "LoRA scaling: the adapter adds B A x lora_alpha / lora_rank", CHECKED)
    lora_dropout: float = flag(0.0, "dropout on the adapters' input while training, in [0, 1)", CHECKED)
    lora_targets: str = flag("c_attn,c_proj,c_fc", "comma-separated layers that get adapters: the attention "
                                                    "(c_attn, attn.c_proj) and MLP (c_fc, mlp.c_proj) projections",
                             CHECKED)

    @property
    def from_scratch(self) -> bool:
        return self.init_from == "scratch"

    @property
    def lora_target_list(self) -> list[str]:
        return [t.strip() for t in self.lora_targets.split(",")]

    @property
    def lora_summary(self) -> str | None:
        """What a LoRA run adds, for the run's header (None for a full fine-tune or a run from scratch)."""
        return f"LoRA r={self.lora_rank} on {self.lora_targets}" if self.lora_rank else None

    def __post_init__(self) -> None:
        _positive(self, "n_layer", "n_head", "n_embd", "block_size")
        _non_empty(self, "init_from")
        _finite(self)
        if self.n_embd % self.n_head:
            raise UserError(f"--n_embd ({self.n_embd}) must be divisible by --n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"--dropout must be in [0, 1), got {self.dropout}; use e.g. 0.0 or 0.1")
        init_from = Path(self.init_from).expanduser()
        if init_from.is_file():
            raise UserError(f"--init_from {self.init_from} is a file; pass 'scratch', a Hub id (e.g. gpt2), an HF "
                            "model folder or a run folder")
        if _looks_like_path(self.init_from) and not init_from.exists():
            raise UserError(f"--init_from {self.init_from}: no such folder; pass an existing HF model folder or run "
                            "folder, or a Hub id (e.g. gpt2)")
        self._check_lora()

    def _check_lora(self) -> None:
        """The LoRA flags as far as they can be judged without the model (rank vs layer sizes: `model.lora`)."""
        if self.lora_rank < 0:
            raise UserError(f"--lora_rank must be 0 (full fine-tuning) or a rank of at least 1, got {self.lora_rank}; "
                            "use e.g. 8")
        if not self.lora_rank:
            return
        if self.from_scratch:
            raise UserError("--lora_rank trains adapters on pretrained weights, but --init_from is 'scratch'; pass "
                            "--init_from (a Hub id such as gpt2, an HF folder or a run folder)")
        if not self.lora_alpha > 0:
            raise UserError(f"--lora_alpha must be positive, got {self.lora_alpha}; use e.g. 2 x --lora_rank")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise UserError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}; use e.g. 0.0 or 0.05")
        if not all(self.lora_target_list):
            raise UserError(f"--lora_targets {self.lora_targets!r} has an empty name; pass comma-separated layer "
                            "names, e.g. c_attn,c_proj,c_fc")


@dataclass
class TrainingConfig:
    """The loop: batch geometry, length, clipping, what a non-finite step does, the seed (training.step)."""

    _argument_group_name = "training loop"

    # Batch: total_batch_size (tokens) = micro_batch_size * block_size * processes * accumulation
    total_batch_size: int = flag(512, "tokens per optimizer step; gradient accumulation = total_batch_size / "
                                       "(micro_batch_size x block_size x processes)",
                                 Refused("the batch of every step, in tokens"))
    micro_batch_size: int = flag(2, "sequences per forward pass on each process", ACCEPTED)
    max_steps: int = flag(480, "optimizer steps of the whole run", SCHEDULE)
    grad_clip: float = flag(1.0, "clip the global gradient norm to this; 0 = no clipping (the norm is measured and "
                                 "logged either way)", ACCEPTED)
    on_nan: str = flag("stop", "'stop' (keep the last good checkpoint) or 'skip' the step", ACCEPTED)
    max_nan_skips: int = flag(10, "with --on_nan skip: stop after this many skipped steps in a row", ACCEPTED)
    seed: int = flag(1337, "seed of the initial weights, data order, dropout and samples", Refused("the data order"))
    activation_checkpointing: bool = flag(False, "recompute each transformer block's activations in the backward "
                                                 "pass: far less activation memory for about a third more compute",
                                          ACCEPTED)
    loss_chunk_rows: int | None = flag(None, "the training loss's path: 0 = the full logits and one cross-entropy "
                                             "(inside the compiled model when compiled), N = the logits of N tokens "
                                             "at a time (less memory); default: the device's, 512 on a CPU, 0 on a "
                                             "GPU", ACCEPTED)

    def __post_init__(self) -> None:
        _positive(self, "total_batch_size", "micro_batch_size", "max_steps", "max_nan_skips")
        _finite(self)
        if self.grad_clip < 0:
            raise UserError(f"--grad_clip must be 0 (no clipping) or more (the max gradient norm), got "
                            f"{self.grad_clip}; use e.g. 1.0")
        if self.on_nan not in ON_NAN:
            raise UserError(f"--on_nan must be 'stop' or 'skip', got {self.on_nan!r}")
        if not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"--seed must be in [0, {MAX_SEED}], got {self.seed}")
        if self.loss_chunk_rows is not None and self.loss_chunk_rows < 0:
            raise UserError(f"--loss_chunk_rows must be 0 (the full logits) or a number of rows per chunk, got "
                            f"{self.loss_chunk_rows}; pass 0 or e.g. 512, or leave it out for the device's default")


def parallelism_group() -> type:
    """The launch's degrees as a flag group: `--NAME N` for each registered degree (`common.parallelism.DEGREES`
    declares its help and its resume rule; 1 = not split). Built from the registry when the flags are read, so a
    degree registered later (a test's toy) has its flag. `Parallelism.of_flags` reads it."""
    return _degree_flags(tuple(DEGREES.values()))


@functools.cache  # one class per set of degrees: two configs of the same flags compare equal
def _degree_flags(degrees: tuple[Degree, ...]) -> type:
    def check(self: Any) -> None:
        _positive(self, *(degree.name for degree in degrees))

    return make_dataclass("ParallelismConfig", [(d.name, int, flag(1, d.help, d.resume)) for d in degrees],
                          namespace={"_argument_group_name": "parallelism", "__post_init__": check,
                                     "__doc__": "How the launch splits the model over its processes."})


# AdamW's peak learning rate when --lr is not given, by what trains (measured: docs/benchmarks.md). From scratch
# with Muon, AdamW trains only the embeddings/output layer, biases and LayerNorms (Muon has --muon_lr).
DEFAULT_LRS = {"from scratch with Muon": 3e-2, "from scratch with AdamW": 1e-3, "full fine-tuning": 1e-4,
               "LoRA": 3e-4}


@dataclass
class OptimConfig:
    """The optimizers and the learning-rate schedule (training.optimizers.plan)."""

    _argument_group_name = "optimizer and schedule"

    # Linear warmup, then cosine decay to lr * min_lr_ratio
    lr: float | None = flag(None, "peak learning rate of AdamW (with Muon: of the embeddings/output layer, biases "
                                  "and LayerNorms), reached after --warmup_steps; default: by what trains, "
                                  + ", ".join(f"{lr:g} {job}" for job, lr in DEFAULT_LRS.items()), SCHEDULE)
    min_lr_ratio: float = flag(0.1, "the cosine decay ends at lr x min_lr_ratio, at --max_steps", SCHEDULE)
    warmup_steps: int = flag(40, "steps of linear warmup from lr / warmup_steps to lr", SCHEDULE)
    weight_decay: float = flag(0.1, "AdamW weight decay, on weights of 2 or more dimensions (matrices, embeddings)",
                               RESTORED)
    beta1: float = flag(0.9, "AdamW beta1", RESTORED)
    beta2: float = flag(0.99, "AdamW beta2 (the GPT-2 presets: 0.95)", RESTORED)
    optimizer: str = flag("auto", "'muon' (torch.optim.Muon on the blocks' 2-D weights, AdamW with --lr on "
                                  "embeddings/output layer, biases and LayerNorms), 'adamw' (every parameter), or "
                                  "'auto': muon with --init_from scratch, adamw to fine-tune pretrained weights",
                          CHECKED)

    def __post_init__(self) -> None:
        _non_negative(self, "warmup_steps")
        _finite(self)
        if self.lr is not None and not self.lr > 0:
            raise UserError(f"--lr must be positive, got {self.lr}; use e.g. 6e-4, or leave it out for the default "
                            "of what trains")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(f"--min_lr_ratio must be in [0, 1] (the final LR is lr * min_lr_ratio), "
                            f"got {self.min_lr_ratio}; use e.g. 0.1")
        if self.weight_decay < 0:
            raise UserError(f"--weight_decay must be 0 or more, got {self.weight_decay}; use e.g. 0.1, or 0 for none")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"--{name} must be in [0, 1), got {getattr(self, name)}; "
                                "use e.g. 0.9 (beta1) or 0.95 (beta2)")


@dataclass
class EvalConfig:
    """What every evaluation during training shares (training.evaluations.runner). Each evaluation's own flags
    (`--eval_every`, `--hellaswag_every`, ...) are its module's, added by `training.evaluations.registry`."""

    _argument_group_name = "evaluation"

    eval_batch_size: int | None = flag(None, "sequences (validation) or HellaSwag items per evaluation forward pass; "
                                             "default: --micro_batch_size (an evaluation then peaks under a step)",
                                       ACCEPTED)

    def __post_init__(self) -> None:
        if self.eval_batch_size is not None:
            _positive(self, "eval_batch_size")


@dataclass
class LogConfig:
    """Console lines, metrics.jsonl and the trackers (training.metrics)."""

    _argument_group_name = "logging and trackers"

    log_every: int = flag(10, "log a line (loss, lr, grad norm, tokens/s, MFU, ETA) every N steps", ACCEPTED)
    report_to: str = flag("none", "'none', 'tensorboard', 'wandb', 'trackio' (a local dashboard, no account: "
                                  "pip install -e \".[trackio]\"), or 'all' (tensorboard and wandb)", ACCEPTED)
    wandb_project: str = flag("gpt2-accelerate", "wandb or trackio project (with --report_to wandb or trackio)",
                              ACCEPTED)
    run_name: str | None = flag(None, "run name for the trackers; default: the --out_dir folder's name", ACCEPTED)
    mfu_peak_flops: float | None = flag(None, "bf16 peak FLOP/s per device for MFU; default: the "
                                              "accelerator's if known (none on CPU or an unlisted GPU: no MFU)",
                                        ACCEPTED)

    def __post_init__(self) -> None:
        _positive(self, "log_every")
        _non_empty(self, "wandb_project", "run_name")
        _finite(self)
        if self.report_to not in REPORT_TO:
            raise UserError(f"--report_to must be one of {', '.join(REPORT_TO)}, got {self.report_to!r}")
        if self.mfu_peak_flops is not None and not self.mfu_peak_flops > 0:
            raise UserError(f"--mfu_peak_flops must be positive (FLOP/s, e.g. 989e12 for an H100), "
                            f"got {self.mfu_peak_flops}; leave it out to use the accelerator's own")


@dataclass
class HubConfig:
    """Pushes of the run to the Hugging Face Hub (publish.uploads)."""

    _argument_group_name = "Hub"

    push_to_hub: bool = flag(False, "push final/ to the Hub at the end (needs --hub_model_id)", ACCEPTED)
    hub_model_id: str | None = flag(None, "Hub repo to push to, user/name; default: none", ACCEPTED)
    hub_push_every: int = flag(0, "also push every K-th checkpoint to branch step-N; 0 = never", ACCEPTED)

    def __post_init__(self) -> None:
        _non_negative(self, "hub_push_every")
        _non_empty(self, "hub_model_id")
        if self.push_to_hub and not self.hub_model_id:
            raise UserError("--push_to_hub needs --hub_model_id user/name")


@dataclass
class PresetConfig:
    """The presets the flags start from (`--config FILE`, repeatable, or FILE given first): after parsing, every
    preset read, includes too, in the order applied (`configs.parse_config`)."""

    _argument_group_name = "preset"

    config: list[str] | None = flag(
        None, "YAML preset, e.g. configs/shakespeare.yaml (or given first, without --config); repeat --config to "
        "apply several in order, each over the ones before; a `config:` key in a preset includes other presets, read "
        "relative to it, before its own values; flags override every preset; default: none, the values below",
        NOT_COMPARED)

    def __post_init__(self) -> None:
        if self.config is not None and not all(path.strip() for path in self.config):
            raise UserError("--config is empty; pass a preset's path, e.g. configs/shakespeare.yaml, or leave the flag "
                            "out")


# The groups in command-line order; `TrainConfig` has one attribute per group, named as here. The degrees' group is
# rebuilt from their registry whenever all the groups are asked for (`all_groups`).
GROUPS: dict[str, type] = {"preset": PresetConfig, "run": RunConfig, "model": ModelConfig, "data": DataConfig,
                           "training": TrainingConfig, "parallelism": parallelism_group(), "optim": OptimConfig,
                           "eval": EvalConfig, "log": LogConfig, "hub": HubConfig}
# Groups that a component above this package declares for itself and adds when it is imported (each optimizer's and
# each evaluation's own flags: `training.optimizers.registry`, `training.evaluations.registry`); they follow GROUPS on
# the command line and in config.yaml.
ADDED: dict[str, type] = {}


def add_group(name: str, group: type) -> None:
    """Add a component's own flag group (a dataclass of `flag` fields, checking its values in `__post_init__`).
    Its name and its flags must be new."""
    taken = {f.name for g in all_groups().values() for f in fields(g)}
    if name in all_groups() or taken & {f.name for f in fields(group)}:
        raise ValueError(f"a flag group named {name!r}, or one with its flags, is already there")
    ADDED[name] = group


def remove_group(name: str) -> None:
    ADDED.pop(name, None)


def all_groups() -> dict[str, type]:
    """Every flag group, in command-line order: this package's (the degrees' as registered now), then the added
    ones."""
    return {**GROUPS, "parallelism": parallelism_group(), **ADDED}


@dataclass
class TrainConfig:
    """A whole run's configuration: one group per component, and the rules that involve two groups."""

    preset: PresetConfig = field(default_factory=PresetConfig)
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: Any = field(default_factory=lambda: parallelism_group()())  # `parallelism_group`
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    added: dict[str, Any] = field(default_factory=lambda: {name: group() for name, group in ADDED.items()})

    def __post_init__(self) -> None:
        check_val_tokens(self.data.val_tokens, self.model.block_size, block_flag="--block_size",
                         block_changed=self.data.val_tokens == DEFAULT_VAL_TOKENS)
        if self.eval.eval_batch_size is None:  # resolved once: config.yaml records the number (eval.val_loss reads it)
            self.eval.eval_batch_size = self.training.micro_batch_size

    def flat(self) -> dict[str, Any]:
        """Every field by its flag name, in command-line order (the keys of `config.yaml`)."""
        return {f.name: getattr(group, f.name) for group in self.groups() for f in fields(group)}

    def groups(self) -> list[Any]:
        return [getattr(self, name) for name in GROUPS] + list(self.added.values())


def field_types() -> dict[str, Any]:
    """Every flag's declared type, e.g. {"lr": float, "hellaswag_limit": int | None}."""
    return {name: hint for group in all_groups().values() for name, hint in typing.get_type_hints(group).items()
            if not name.startswith("_")}


def field_names() -> list[str]:
    return [f.name for group in all_groups().values() for f in fields(group)]


def resume_rules() -> dict[str, str | Refused]:
    """What a resume may do with each field, as the field declares it (`common.resume_rules`), in command-line order."""
    return {f.name: resume_rule(f.metadata) for group in all_groups().values() for f in fields(group)}
