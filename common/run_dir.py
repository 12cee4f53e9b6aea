"""The layout of a training run's folder (`--out_dir`), written down once.

    <out_dir>/
      config.yaml              the run's TrainConfig (after a resume is accepted), and what resumes changed
      metrics.jsonl            one JSON object per logged step
      harness.jsonl            one JSON object per `python -m eval.harness` call on this run's weights
      tensorboard/             when --report_to tensorboard
      checkpoints/step_000100/ accelerate's save_state files plus the files named below
      final/                   the finished model as a Hugging Face GPT-2 folder (a LoRA run: merged)
      final_adapter/           a LoRA run's adapter as a PEFT folder, for transformers' GPT2LMHeadModel
      hub_export/              what the last Hub push uploaded (kept for retries)
      superseded/<when>/       checkpoints (and final/, metrics) set aside by a resume from an older step
      .lock                    held by the run writing into the folder

A checkpoint folder is complete once it holds `gpt_config.json`: checkpoints are built under a
temporary name and renamed into place last (see `common.atomic`), so a listed one is never
half-written.
"""
from __future__ import annotations

import re
from pathlib import Path

from accelerate.utils.constants import FSDP_MODEL_NAME, MODEL_NAME, OPTIMIZER_NAME, RNG_STATE_NAME, SAFE_WEIGHTS_NAME

# Files inside a checkpoint folder that we write.
GPT_CONFIG = "gpt_config.json"  # the architecture, `dataclasses.asdict(GPTConfig)`
RUN_STATE = "run_state.json"  # step, tokens seen, tracker run id, world size
MANIFEST = "manifest.json"  # every other file's size and sha256, written last
# A LoRA run's checkpoint holds its adapter instead of the whole model (peft's file names; see model/lora.py).
ADAPTER_CONFIG = "adapter_config.json"  # the LoRA settings and the base weights' name (and revision)
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the adapter weights only
# What accelerate's save_state writes, named from accelerate's own constants (as its checkpointing composes them).
MODEL_WEIGHTS = SAFE_WEIGHTS_NAME  # model.safetensors: the (possibly wrapped) model's state dict
FSDP_MODEL_DIR = f"{FSDP_MODEL_NAME}_0"  # pytorch_model_fsdp_0/: the model's shards under FSDP's sharded state
DEEPSPEED_DIR = MODEL_NAME  # pytorch_model/: DeepSpeed's checkpoint (model states, one optimizer partition per rank)
DEEPSPEED_LATEST = "latest"  # the name of the DeepSpeed checkpoint folder beside it, as DeepSpeed writes it
_STEP_DIR = re.compile(r"^step_(\d+)$")


def optimizer_file(index: int) -> str:
    """accelerate's file for the `index`-th prepared optimizer: optimizer.bin, optimizer_1.bin, ..."""
    return f"{OPTIMIZER_NAME}.bin" if index == 0 else f"{OPTIMIZER_NAME}_{index}.bin"


def fsdp_optimizer_dir(index: int) -> str:
    """The folder of the `index`-th optimizer's shards under FSDP's sharded state: optimizer_0/, optimizer_1/, ..."""
    return f"{OPTIMIZER_NAME}_{index}"


def rng_state_file(rank: int) -> str:
    """accelerate's file for process `rank`'s RNG states: random_states_{rank}.pkl."""
    return f"{RNG_STATE_NAME}_{rank}.pkl"


def data_state_file(rank: int) -> str:
    """The name of rank `rank`'s data-loader position inside a checkpoint."""
    return f"data_state_rank{rank}.json"


def checkpoint_step(checkpoint: Path) -> int | None:
    """The optimizer step of a `step_N` folder, None for any other name."""
    match = _STEP_DIR.match(Path(checkpoint).name)
    return int(match.group(1)) if match else None


def kept_instead(missing: Path) -> str | None:
    """For a `step_N` folder of a run's checkpoints/ that is not there (rotated away, never saved): what the run keeps,
    e.g. `the run keeps step_000300, step_000400, step_000480 and final/`; None for any other path."""
    missing = Path(missing)
    if checkpoint_step(missing) is None or missing.parent.name != "checkpoints" or not missing.parent.is_dir():
        return None
    run = RunDir(missing.parent.parent)
    kept = [p.name for p in run.list_checkpoints()] + (["final/"] if run.has_final() else [])
    if not kept:
        return "the run keeps no checkpoint yet"
    return f"the run keeps {', '.join(kept[:-1]) + ' and ' if len(kept) > 1 else ''}{kept[-1]}"


class RunDir:
    """Paths inside one run folder, and which of its checkpoints and weights are complete."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @classmethod
    def holding(cls, folder: str | Path) -> RunDir | None:
        """The run folder whose `final/` or `checkpoints/step_N` is `folder`; None for any other folder."""
        folder = Path(folder)
        for run in (cls(folder.parent), cls(folder.parent.parent)):
            if folder == run.final or (folder.parent == run.checkpoints and checkpoint_step(folder) is not None):
                return run
        return None

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunDir) and self.path == other.path

    def __hash__(self) -> int:
        return hash(self.path)

    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def harness_file(self) -> Path:
        return self.path / "harness.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def final(self) -> Path:
        return self.path / "final"

    @property
    def final_adapter(self) -> Path:
        return self.path / "final_adapter"

    @property
    def hub_export(self) -> Path:
        return self.path / "hub_export"

    @property
    def superseded(self) -> Path:
        return self.path / "superseded"

    @property
    def lock_file(self) -> Path:
        return self.path / ".lock"

    def checkpoint(self, step: int) -> Path:
        """The folder of the checkpoint taken after optimizer step `step`."""
        return self.checkpoints / f"step_{step:06d}"

    def list_checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.checkpoints.is_dir():
            return []
        found = [(step, p) for p in self.checkpoints.iterdir()
                 if (step := checkpoint_step(p)) is not None and (p / GPT_CONFIG).is_file()]
        return [p for _, p in sorted(found)]

    def latest_checkpoint(self) -> Path | None:
        found = self.list_checkpoints()
        return found[-1] if found else None

    def has_final(self) -> bool:
        return (self.final / "config.json").is_file()

    def looks_like_run(self) -> bool:
        """True when the folder has a final/ or checkpoints/ folder (finished or not)."""
        return self.final.is_dir() or self.checkpoints.is_dir()

    def newest_weights(self) -> Path | None:
        """`final/` if the run finished, else its newest complete checkpoint, else None."""
        return self.final if self.has_final() else self.latest_checkpoint()
