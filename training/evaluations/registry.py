"""The evaluations a run scores while it trains, in the order they run after a step: one registration line each."""
from __future__ import annotations

from configs.schema import add_group, remove_group
from training.evaluations import hellaswag, validation
from training.evaluations.spec import EvaluationSpec

EVALUATIONS: dict[str, EvaluationSpec] = {}


def register(spec: EvaluationSpec) -> EvaluationSpec:
    """Add an evaluation (its name and its metrics keys must be new), and its own flags to train.py's."""
    keys = {m.key for other in EVALUATIONS.values() for m in other.metrics}
    if spec.name in EVALUATIONS or keys & {m.key for m in spec.metrics}:
        raise ValueError(f"an evaluation named {spec.name!r}, or one logging its metrics, is already registered")
    if spec.flags is not None:
        add_group(spec.name, spec.flags)
    EVALUATIONS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Take an evaluation out again, with its flags (a test's toy)."""
    spec = EVALUATIONS.pop(name, None)
    if spec is not None and spec.flags is not None:
        remove_group(name)


register(validation.SPEC)
register(hellaswag.SPEC)
