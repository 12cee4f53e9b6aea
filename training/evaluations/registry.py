"""The evaluations a run scores while it trains, in the order they run after a step: one registration line each."""
from __future__ import annotations

from training.evaluations import hellaswag, validation
from training.evaluations.spec import EvaluationSpec

EVALUATIONS: dict[str, EvaluationSpec] = {}


def register(spec: EvaluationSpec) -> EvaluationSpec:
    """Add an evaluation (its name and its metrics keys must be new)."""
    keys = {m.key for other in EVALUATIONS.values() for m in other.metrics}
    if spec.name in EVALUATIONS or keys & {m.key for m in spec.metrics}:
        raise ValueError(f"an evaluation named {spec.name!r}, or one logging its metrics, is already registered")
    EVALUATIONS[spec.name] = spec
    return spec


register(validation.SPEC)
register(hellaswag.SPEC)
