"""A checkpoint's integrity before a resume: every file a resume reads is there and unchanged.

Before a resume loads anything, `verify_checkpoint` checks that every file a resume reads is present and, against the
checkpoint's manifest (`checkpoint_io.manifest`, the one home of the manifest and of its check, which every command that
reads a checkpoint's weights runs too), unchanged: a damaged checkpoint is one line naming the file and the earlier
checkpoint to resume from, never a traceback or a silently inexact resume. Checkpoints written before manifests
existed (run_state format 1) are checked for the presence of every file and for readable RNG states.
"""
from __future__ import annotations

from accelerate.utils import load as accelerate_load

from checkpoint_io.manifest import FORMAT, damage
from common.errors import UserError
from common.run_dir import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    DEEPSPEED_DIR,
    DEEPSPEED_LATEST,
    FSDP_MODEL_DIR,
    GPT_CONFIG,
    MANIFEST,
    MODEL_WEIGHTS,
    RUN_STATE,
    data_state_file,
    fsdp_optimizer_dir,
    optimizer_file,
    rng_state_file,
)
from training.checkpoints.resume import ResumePoint, fallback_advice


def _required_files(point: ResumePoint) -> list[str]:
    """What a resume reads: our state files and manifest, every saved rank's RNG and data state, the model and
    each optimizer."""
    names = [GPT_CONFIG, RUN_STATE] + ([MANIFEST] if point.run_state.get("format", 1) >= FORMAT else [])
    names += [rng_state_file(rank) for rank in range(point.world_size)]
    names += [data_state_file(rank) for rank in range(point.data_ranks)]
    if (point.path / ADAPTER_CONFIG).is_file():  # a LoRA run's: the adapter in place of the model
        return names + [ADAPTER_CONFIG, ADAPTER_WEIGHTS, optimizer_file(0)]
    if (point.path / FSDP_MODEL_DIR).is_dir():
        return names + [FSDP_MODEL_DIR] + [fsdp_optimizer_dir(i) for i in range(len(point.optimizers))]
    if (point.path / DEEPSPEED_DIR).is_dir():
        return names + [DEEPSPEED_DIR, DEEPSPEED_LATEST]
    return names + [MODEL_WEIGHTS] + [optimizer_file(i) for i in range(len(point.optimizers))]


def verify_checkpoint(point: ResumePoint) -> None:
    """Check that everything `load_checkpoint` will read is present and unchanged since it was saved."""
    advice = fallback_advice(point.path)
    for name in _required_files(point):
        if not (point.path / name).exists():
            raise UserError(f"checkpoint {point.path} is incomplete: {name} is missing; {advice}")
    if (point.path / MANIFEST).is_file() and (problem := damage(point.path)) is not None:
        raise UserError(f"{problem}; {advice}")
    # accelerate swallows a failed RNG load (it logs at info level and goes on: a silently inexact resume),
    # so read the RNG states here first, the way it will: weights_only, which never runs pickled code.
    for rank in range(point.world_size):
        file = point.path / rng_state_file(rank)
        try:
            accelerate_load(file)
        except Exception as err:  # noqa: BLE001 - any failure to unpickle is a damaged file here
            raise UserError(f"checkpoint file {file} cannot be read ({type(err).__name__}); {advice}") from None
