"""The optimizers `--optimizer` can name: one registration line per optimizer module.

`auto` is not one of them; `training.optimizers.plan.plan_optimizers` resolves it."""
from __future__ import annotations

from common.errors import UserError
from configs.schema import add_group, remove_group
from training.optimizers import adamw, muon
from training.optimizers.spec import OptimizerSpec

OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register(spec: OptimizerSpec) -> OptimizerSpec:
    """Add an optimizer (its `--optimizer` name must be new), and its own flags to train.py's."""
    if spec.name in OPTIMIZERS or spec.name == "auto":
        raise ValueError(f"an optimizer named {spec.name!r} is already registered")
    if spec.build is None or spec.peak_lr is None:
        raise ValueError(f"optimizer {spec.name!r} must declare its build and peak_lr")
    if spec.flags is not None:
        add_group(spec.name, spec.flags)
    OPTIMIZERS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Take an optimizer out again, with its flags (a test's toy)."""
    OPTIMIZERS.pop(name, None)
    remove_group(name)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The registered optimizer `--optimizer name` means; a name not registered is one line."""
    if name not in OPTIMIZERS:
        raise UserError(f"--optimizer must be one of auto, {', '.join(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZERS[name]


register(adamw.SPEC)
register(muon.SPEC)
