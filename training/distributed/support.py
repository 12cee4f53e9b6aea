"""What runs under what: every feature refused under some engine, against every engine, with its one-line reason and
fix. The engines' names are `common.engine_names`'s; the degrees and the table's columns `common.parallelism`'s.

The refusals before a run, the memory planner's, and the support table of the README and docs/engines.md all read
`support()`; a test holds both tables equal to `support_table()`. A feature that starts to run under an engine is
one cell here.

A refusal may also depend on a setting of the run (`Refusal.unless`): Muon under ZeRO runs with `--grad_clip 0` only.
`conditions(...)` gives the settings such refusals read. Refusals that depend on a config's contents, not on the
engine, stay with the config reading in `training.distributed.engines`.
"""
from __future__ import annotations

from common.engine_names import ENGINE_COLUMNS, FSDP_COLUMN, ZERO_COLUMNS, Refusal
from common.parallelism import DEGREES, Degree, Parallelism, columns
from training.optimizers.registry import OPTIMIZERS

_LORA_WHY = ("the adapters are a few MB: there is nothing worth sharding, and its checkpoints would gather and shard "
             "the frozen base")
_LORA_FIX = "use a DDP or single-process accelerate config"

# feature (as the user asks for it) -> column -> Refusal; a column not named runs it. Each optimizer declares its
# own row (`OptimizerSpec.refused_under`), each degree its own column's cells (`Degree.refuses`) and its row is
# derived (`degree_row`); `support()` joins them.
SUPPORT: dict[str, dict[str, Refusal]] = {
    "--lora_rank": {
        FSDP_COLUMN: Refusal(_LORA_WHY, _LORA_FIX),
        **{ZERO_COLUMNS[s]: Refusal(_LORA_WHY, _LORA_FIX) for s in (1, 2, 3)},
    },
    "--on_nan skip": {
        ZERO_COLUMNS[s]: Refusal("DeepSpeed applies the update inside the step's backward, before the gradient norm is "
                             "known here", "use --on_nan stop") for s in (1, 2, 3)
    },
}


def support() -> dict[str, dict[str, Refusal]]:
    """The whole table: each registered optimizer refused somewhere (`--optimizer NAME`), then `SUPPORT` with each
    degree's cells, then each registered degree's row (`degree_row`)."""
    table = {f"--optimizer {name}": dict(spec.refused_under) for name, spec in OPTIMIZERS.items()
             if spec.refused_under}
    table |= {feature: dict(row) for feature, row in SUPPORT.items()}
    for degree in DEGREES.values():
        for feature, refused in degree.refuses.items():
            table.setdefault(feature, {})[degree.column] = refused
    return table | {degree.flag: degree_row(degree) for degree in DEGREES.values()}


def degree_row(degree: Degree) -> dict[str, Refusal]:
    """A degree's row: refused under the engines it does not run on (`Degree.needs`), and beside any other degree
    (no two are combined yet)."""
    own = Parallelism(degree.engine).column
    row = {column: degree.needs for column in ENGINE_COLUMNS if column != own}
    for other in DEGREES.values():
        if other != degree:
            row[other.column] = Refusal(f"{degree.groups} inside {other.groups} are not built yet",
                                        f"choose one of {other.flag} and {degree.flag}")
    return row


def costs() -> dict[str, dict[str, str]]:
    """Feature -> column -> the note of a "runs" cell: what a registered optimizer costs there beyond the engine's
    own work (`OptimizerSpec.costs_under`)."""
    return {f"--optimizer {name}": dict(spec.costs_under) for name, spec in OPTIMIZERS.items() if spec.costs_under}


def conditions(grad_clip: float) -> frozenset[str]:
    """The run's settings that a refusal may depend on (`Refusal.unless`), spelled as in the table."""
    return frozenset({"--grad_clip 0"} if grad_clip == 0 else ())


def refusal(feature: str, parallelism: Parallelism, asked: str | None = None,
            settings: frozenset[str] = frozenset()) -> str | None:
    """The one-line refusal of `feature` under `parallelism`, or None where it runs.

    `asked` is the flag as the user gave it (`--tensor_parallel 4`). A refusal whose `unless` is in `settings` lets
    the feature run."""
    refused = support().get(feature, {}).get(parallelism.column)
    if refused is None or refused.unless in settings:
        return None
    where = f"under {parallelism.name}"
    if parallelism.split:  # the degree whose column it is
        degree, n = parallelism.split[-1]
        where = f"with {degree.flag} {n}"
    return f"{asked or feature} is not supported {where} ({refused.why}); {refused.fix}"


def support_table() -> str:
    """The support table of the README and docs/engines.md: every feature refused somewhere, against every column."""
    lines = ["| feature | " + " | ".join(columns()) + " |", "| --- |" + " --- |" * len(columns())]
    notes = costs()

    def cell(refused: Refusal | None, cost: str | None) -> str:
        runs = "runs" if refused is None else f"runs with `{refused.unless}`" if refused.unless else "refused"
        return f"{runs} ({cost})" if cost and runs != "refused" else runs

    for feature, refused in support().items():
        cells = [cell(refused.get(c), notes.get(feature, {}).get(c)) for c in columns()]
        lines.append(f"| `{feature}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
