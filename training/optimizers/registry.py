"""The optimizers `--optimizer` can name: one registration line per optimizer module.

`--optimizer auto` is not one of them: it is resolved to one (`training.optimizers.plan.plan_optimizers`)."""
from __future__ import annotations

from common.errors import UserError
from training.optimizers import adamw, muon
from training.optimizers.spec import OptimizerSpec

OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register(spec: OptimizerSpec) -> OptimizerSpec:
    """Add an optimizer (its `--optimizer` name must be new; only AdamW, the base, claims no parameters)."""
    if spec.name in OPTIMIZERS or spec.name == "auto":
        raise ValueError(f"an optimizer named {spec.name!r} is already registered")
    if (spec.claims is None) != (spec.name == "adamw") or spec.build is None or spec.peak_lr is None:
        raise ValueError(f"optimizer {spec.name!r} must claim parameters (AdamW trains the rest) and declare its "
                         "build and peak_lr")
    OPTIMIZERS[spec.name] = spec
    return spec


def optimizer_spec(name: str) -> OptimizerSpec:
    """The registered optimizer `--optimizer name` means; a name not registered is one line."""
    if name not in OPTIMIZERS:
        raise UserError(f"--optimizer must be one of auto, {', '.join(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZERS[name]


register(adamw.SPEC)
register(muon.SPEC)
