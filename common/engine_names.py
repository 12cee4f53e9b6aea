"""How the project names its engines, the one place they are spelled, and the columns of the support table.

A DeepSpeed engine's name carries its ZeRO stage; tensor parallelism rides on FSDP2 and has a column of its own.
`training.distributed.support` holds the table itself; the optimizers' modules (`training.optimizers`) declare their
cells.
"""
from __future__ import annotations

from dataclasses import dataclass

# How the project names each engine, the one place: a DeepSpeed engine's name carries its ZeRO stage.
DDP, FSDP, DEEPSPEED = "ddp", "fsdp", "deepspeed"
ENGINE_NAMES = {DDP: "DDP", FSDP: "FSDP2", DEEPSPEED: "DeepSpeed ZeRO-{stage}"}
# The family an accelerate config asks for, before its stage is known ("the accelerate config asks for DeepSpeed").
FAMILY_NAMES = {DDP: "DDP", FSDP: "FSDP", DEEPSPEED: "DeepSpeed"}


def engine_name(kind: str, zero_stage: int = 0, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> str:
    """"DDP", "FSDP2", "DeepSpeed ZeRO-2" ("DeepSpeed" while the stage is not known), with its `degrees`."""
    name = ENGINE_NAMES[kind].format(stage=zero_stage) if zero_stage or kind != DEEPSPEED else FAMILY_NAMES[kind]
    return name + degrees(tensor_parallel, pipeline_parallel)


def degrees(tensor_parallel: int = 1, pipeline_parallel: int = 1) -> str:
    """" x tensor parallel N" when the blocks are split over N ranks, " x pipeline N" when they are N stages: how
    every name of a launch (the engine's, the run header's, the plan's) ends."""
    return (f" x tensor parallel {tensor_parallel}" if tensor_parallel > 1 else "") + \
        (f" x pipeline {pipeline_parallel}" if pipeline_parallel > 1 else "")


# The support table's columns: each engine a launch can run, tensor parallelism (which rides on FSDP2) and pipeline
# parallelism (on DDP's launch).
DDP_COLUMN, FSDP_COLUMN = ENGINE_NAMES[DDP], ENGINE_NAMES[FSDP]
ZERO_COLUMNS = {stage: f"ZeRO-{stage}" for stage in (1, 2, 3)}
TP_COLUMN, PP_COLUMN = f"{FSDP_COLUMN} x TP", f"{DDP_COLUMN} x PP"
COLUMNS = (DDP_COLUMN, FSDP_COLUMN, *ZERO_COLUMNS.values(), TP_COLUMN, PP_COLUMN)


def column(kind: str, zero_stage: int = 0, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> str:
    """The support table's column of a launch."""
    if pipeline_parallel > 1:
        return PP_COLUMN
    if tensor_parallel > 1:
        return TP_COLUMN
    return ZERO_COLUMNS[zero_stage] if kind == DEEPSPEED else ENGINE_NAMES[kind]


@dataclass(frozen=True)
class Refusal:
    """Why a feature does not run under an engine, and what to do instead; `unless`: a setting of the run under which
    it runs there after all (`"--grad_clip 0"`), which the fix names and the support table's cell says."""

    why: str
    fix: str
    unless: str | None = None
