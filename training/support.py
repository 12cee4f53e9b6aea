"""What runs under what: the engines' display names, and every feature refused under some engine, against every
engine, with its one-line reason and fix.

The refusals before a run (`training.engines.refuse_unsupported`, `training.layout.Layout.checked`),
the memory planner's (`planner.Launch`) and the README's support table all read `SUPPORT`; a test
holds the README's table equal to `support_table()`. A feature that starts to run under an engine is one cell here.

Refusals that hang on a config's contents rather than on the engine (a DeepSpeed config's own optimizer block;
accelerate's activation checkpointing beside ours) stay beside the config reading, in `training.engines`.
"""
from __future__ import annotations

from dataclasses import dataclass

# How the project names each engine, the one place: a DeepSpeed engine's name carries its ZeRO stage.
DDP, FSDP, DEEPSPEED = "ddp", "fsdp", "deepspeed"
ENGINE_NAMES = {DDP: "DDP", FSDP: "FSDP2", DEEPSPEED: "DeepSpeed ZeRO-{stage}"}
# The family an accelerate config asks for, before its stage is known ("the accelerate config asks for DeepSpeed").
FAMILY_NAMES = {DDP: "DDP", FSDP: "FSDP", DEEPSPEED: "DeepSpeed"}


def engine_name(kind: str, zero_stage: int = 0, tensor_parallel: int = 1) -> str:
    """"DDP", "FSDP2", "DeepSpeed ZeRO-2" ("DeepSpeed" while the stage is not known), with " x tensor parallel N"
    when the blocks are split over N ranks."""
    name = ENGINE_NAMES[kind].format(stage=zero_stage) if zero_stage or kind != DEEPSPEED else FAMILY_NAMES[kind]
    return name + (f" x tensor parallel {tensor_parallel}" if tensor_parallel > 1 else "")


# The support table's columns: each engine a launch can run, and tensor parallelism (which rides on FSDP2).
COLUMNS = ("DDP", "FSDP2", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2 x TP")


def column(kind: str, zero_stage: int = 0, tensor_parallel: int = 1) -> str:
    """The support table's column of a launch."""
    if tensor_parallel > 1:
        return "FSDP2 x TP"
    return f"ZeRO-{zero_stage}" if kind == DEEPSPEED else ENGINE_NAMES[kind]


@dataclass(frozen=True)
class Refusal:
    """Why a feature does not run under an engine, and what to do instead."""

    why: str
    fix: str


_MUON_WHY = "Muon orthogonalises whole matrices; {}"
_LORA_WHY = ("the adapters are a few MB: there is nothing worth sharding, and its checkpoints would gather and shard "
             "the frozen base")
_LORA_FIX = "use a DDP or single-process accelerate config"
_TP_FIX = "launch with accelerate_configs/fsdp_8gpu.yaml, or leave out --tensor_parallel"
_TP_WHY = "it runs on accelerate's FSDP2 plugin, FSDP2 across the tensor-parallel groups"

# feature (as the user asks for it) -> column -> Refusal; a column not named runs it.
SUPPORT: dict[str, dict[str, Refusal]] = {
    "--optimizer muon": {
        "FSDP2": Refusal(_MUON_WHY.format("FSDP shards them"),
                         "use --optimizer adamw with FSDP2, or Muon with a DDP launch config"),
        **{f"ZeRO-{s}": Refusal(_MUON_WHY.format("ZeRO flattens and partitions them"),
                                f"use --optimizer adamw with {engine_name(DEEPSPEED, s)}, or Muon with a DDP "
                                "launch config")
           for s in (1, 2, 3)},
        "FSDP2 x TP": Refusal("Muon orthogonalises whole matrices, which tensor parallelism splits across ranks",
                              "use --optimizer adamw, or Muon without --tensor_parallel under a DDP launch config"),
    },
    "--lora_rank": {
        "FSDP2": Refusal(_LORA_WHY, _LORA_FIX),
        **{f"ZeRO-{s}": Refusal(_LORA_WHY, _LORA_FIX) for s in (1, 2, 3)},
        "FSDP2 x TP": Refusal("peft's adapters wrap the layers tensor parallelism splits",
                              "drop --tensor_parallel (a DDP or single-process config)"),
    },
    "--on_nan skip": {
        f"ZeRO-{s}": Refusal("DeepSpeed applies the update inside the step's backward, before the gradient norm is "
                             "known here", "use --on_nan stop") for s in (1, 2, 3)
    },
    "--tensor_parallel": {
        "DDP": Refusal(_TP_WHY, _TP_FIX),
        **{f"ZeRO-{s}": Refusal(_TP_WHY, _TP_FIX) for s in (1, 2, 3)},
    },
}


def refusal(feature: str, kind: str, zero_stage: int = 0, tensor_parallel: int = 1, asked: str | None = None
            ) -> str | None:
    """The one-line refusal of `feature` under this launch's engine, or None where it runs. `asked`: the flag as
    the user gave it, when it says more than the feature's name (`--tensor_parallel 4`). A DeepSpeed launch whose
    stage is not known yet (0) is read in the ZeRO-1 column: no feature here is refused by one ZeRO stage only."""
    refused = SUPPORT[feature].get(column(kind, zero_stage or (1 if kind == DEEPSPEED else 0), tensor_parallel))
    if refused is None:
        return None
    where = (f"with --tensor_parallel {tensor_parallel}" if tensor_parallel > 1
             else f"under {engine_name(kind, zero_stage)}")
    return f"{asked or feature} is not supported {where} ({refused.why}); {refused.fix}"


def support_table() -> str:
    """The README's table: every feature refused somewhere, against every column ("runs" or "refused")."""
    lines = ["| feature | " + " | ".join(COLUMNS) + " |", "| --- |" + " --- |" * len(COLUMNS)]
    for feature, refused in SUPPORT.items():
        cells = ["refused" if c in refused else "runs" for c in COLUMNS]
        lines.append(f"| `{feature}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
