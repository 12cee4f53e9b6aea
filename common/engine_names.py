"""How the project names its engines, the one place they are spelled, and the engines' columns of the support table.

A DeepSpeed engine's name carries its ZeRO stage. A launch's whole name, with its degrees, and the degrees' columns
are `common.parallelism`'s. `training.distributed.support` holds the table itself; the optimizers' modules
(`training.optimizers`) declare their cells.
"""
from __future__ import annotations

from dataclasses import dataclass

# How the project names each engine, the one place: a DeepSpeed engine's name carries its ZeRO stage.
DDP, FSDP, DEEPSPEED = "ddp", "fsdp", "deepspeed"
ENGINE_NAMES = {DDP: "DDP", FSDP: "FSDP2", DEEPSPEED: "DeepSpeed ZeRO-{stage}"}
# The family an accelerate config asks for, before its stage is known ("the accelerate config asks for DeepSpeed").
FAMILY_NAMES = {DDP: "DDP", FSDP: "FSDP", DEEPSPEED: "DeepSpeed"}

# The support table's columns of the engines; each degree adds its own (`common.parallelism.columns`).
DDP_COLUMN, FSDP_COLUMN = ENGINE_NAMES[DDP], ENGINE_NAMES[FSDP]
ZERO_COLUMNS = {stage: f"ZeRO-{stage}" for stage in (1, 2, 3)}
ENGINE_COLUMNS = (DDP_COLUMN, FSDP_COLUMN, *ZERO_COLUMNS.values())


@dataclass(frozen=True)
class Refusal:
    """Why a feature does not run under an engine, and what to do instead; `unless`: a setting of the run under which
    it runs there after all (`"--grad_clip 0"`), which the fix names and the support table's cell says."""

    why: str
    fix: str
    unless: str | None = None
