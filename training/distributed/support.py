"""What runs under what: every feature refused under some engine, against every engine, with its one-line reason and
fix. The engines' names and the table's columns are `common.engine_names`'s.

The refusals before a run, the memory planner's, and the support table of the README and docs/engines.md all read
`support()`; a test holds both tables equal to `support_table()`. A feature that starts to run under an engine is
one cell here.

A refusal may also depend on a setting of the run (`Refusal.unless`): Muon under ZeRO runs with `--grad_clip 0` only.
`conditions(...)` gives the settings such refusals read. Refusals that depend on a config's contents, not on the
engine, stay with the config reading in `training.distributed.engines`.
"""
from __future__ import annotations

from common.engine_names import (
    COLUMNS,
    DDP_COLUMN,
    DEEPSPEED,
    FSDP_COLUMN,
    PP_COLUMN,
    TP_COLUMN,
    ZERO_COLUMNS,
    Refusal,
    column,
    engine_name,
)
from training.optimizers.registry import OPTIMIZERS

_LORA_WHY = ("the adapters are a few MB: there is nothing worth sharding, and its checkpoints would gather and shard "
             "the frozen base")
_LORA_FIX = "use a DDP or single-process accelerate config"
_TP_FIX = "launch with accelerate_configs/fsdp_8gpu.yaml, or leave out --tensor_parallel"
_TP_WHY = "it runs on accelerate's FSDP2 plugin, FSDP2 across the tensor-parallel groups"
_PP_WHY = "its stages run on a DDP launch, the pipelines' gradients averaged stage by stage; sharding inside a stage " \
          "is not built yet"
_PP_FIX = "launch it with a DDP config (accelerate_configs/8gpu.yaml, cpu_2proc.yaml), or leave out --pipeline_parallel"

# feature (as the user asks for it) -> column -> Refusal; a column not named runs it. Each optimizer declares its
# own row (`OptimizerSpec.refused_under`), and `support()` joins them.
SUPPORT: dict[str, dict[str, Refusal]] = {
    "--lora_rank": {
        FSDP_COLUMN: Refusal(_LORA_WHY, _LORA_FIX),
        **{ZERO_COLUMNS[s]: Refusal(_LORA_WHY, _LORA_FIX) for s in (1, 2, 3)},
        TP_COLUMN: Refusal("peft's adapters wrap the layers tensor parallelism splits",
                              "drop --tensor_parallel (a DDP or single-process config)"),
        PP_COLUMN: Refusal("its checkpoints hold the adapters, which the pipeline's whole-model checkpoints do not "
                            "gather", "drop --pipeline_parallel (the adapters train in a few MB: DDP is enough)"),
    },
    "--on_nan skip": {
        ZERO_COLUMNS[s]: Refusal("DeepSpeed applies the update inside the step's backward, before the gradient norm is "
                             "known here", "use --on_nan stop") for s in (1, 2, 3)
    },
    "--tensor_parallel": {
        DDP_COLUMN: Refusal(_TP_WHY, _TP_FIX),
        **{ZERO_COLUMNS[s]: Refusal(_TP_WHY, _TP_FIX) for s in (1, 2, 3)},
        PP_COLUMN: Refusal("tensor-parallel groups inside pipeline stages are not built yet",
                            "choose one of --pipeline_parallel and --tensor_parallel"),
    },
    "--pipeline_parallel": {
        FSDP_COLUMN: Refusal(_PP_WHY, _PP_FIX),
        **{ZERO_COLUMNS[s]: Refusal(_PP_WHY, _PP_FIX) for s in (1, 2, 3)},
        TP_COLUMN: Refusal("pipeline stages with tensor-parallel groups inside are not built yet",
                              "choose one of --pipeline_parallel and --tensor_parallel"),
    },
}


def support() -> dict[str, dict[str, Refusal]]:
    """The whole table: each registered optimizer refused somewhere (`--optimizer NAME`), then `SUPPORT`."""
    optimizers = {f"--optimizer {name}": dict(spec.refused_under) for name, spec in OPTIMIZERS.items()
                  if spec.refused_under}
    return {**optimizers, **SUPPORT}


def costs() -> dict[str, dict[str, str]]:
    """Feature -> column -> the note of a "runs" cell: what a registered optimizer costs there beyond the engine's
    own work (`OptimizerSpec.costs_under`)."""
    return {f"--optimizer {name}": dict(spec.costs_under) for name, spec in OPTIMIZERS.items() if spec.costs_under}


def conditions(grad_clip: float) -> frozenset[str]:
    """The run's settings that a refusal may depend on (`Refusal.unless`), spelled as in the table."""
    return frozenset({"--grad_clip 0"} if grad_clip == 0 else ())


def refusal(feature: str, kind: str, zero_stage: int = 0, tensor_parallel: int = 1, asked: str | None = None,
            pipeline_parallel: int = 1, settings: frozenset[str] = frozenset()) -> str | None:
    """The one-line refusal of `feature` under this launch's engine, or None where it runs.

    `asked` is the flag as the user gave it (`--tensor_parallel 4`). A refusal whose `unless` is in `settings` lets
    the feature run. A DeepSpeed stage not yet known (0) reads the ZeRO-1 column: no refusal here differs by stage."""
    where_column = column(kind, zero_stage or (1 if kind == DEEPSPEED else 0), tensor_parallel, pipeline_parallel)
    refused = support().get(feature, {}).get(where_column)
    if refused is None or refused.unless in settings:
        return None
    where = (f"with --pipeline_parallel {pipeline_parallel}" if pipeline_parallel > 1
             else f"with --tensor_parallel {tensor_parallel}" if tensor_parallel > 1
             else f"under {engine_name(kind, zero_stage)}")
    return f"{asked or feature} is not supported {where} ({refused.why}); {refused.fix}"


def support_table() -> str:
    """The support table of the README and docs/engines.md: every feature refused somewhere, against every column."""
    lines = ["| feature | " + " | ".join(COLUMNS) + " |", "| --- |" + " --- |" * len(COLUMNS)]
    notes = costs()

    def cell(refused: Refusal | None, cost: str | None) -> str:
        runs = "runs" if refused is None else f"runs with `{refused.unless}`" if refused.unless else "refused"
        return f"{runs} ({cost})" if cost and runs != "refused" else runs

    for feature, refused in support().items():
        cells = [cell(refused.get(c), notes.get(feature, {}).get(c)) for c in COLUMNS]
        lines.append(f"| `{feature}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
