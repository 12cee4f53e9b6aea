"""The plan as the table that `train.py --plan` and `python -m benchmarks.memory_plan` print.
"""
from __future__ import annotations

from planner.advice import Spelling, advice, run_advice
from planner.launch import GB, GiB
from planner.memory import ALLOCATOR_SLACK, MemoryPlan, RunPhases, format_gib, plan_run


def render(plan: MemoryPlan, device_bytes: int, spelling: Spelling | None = None, run: RunPhases | None = None
           ) -> str:
    """The plan as a table (GiB), the activations per layer, and the verdict against the device. With `run`, every
    phase of the run is planned: each one's peak, then the items of the largest, and the verdict on the run.
    `spelling`: how the entry point names the settings its advice changes (default: `Spelling()`)."""
    spelling = spelling or Spelling()
    c, l_ = plan.config, plan.launch
    how = l_.layout.describe()
    precision = "fp32" if l_.dtype == "fp32" else ("bf16 parameters" if l_.fp32_master else "bf16 autocast")
    lines = [
        f"Memory plan (computed from the shapes, not measured): {c.n_layer} layers x {c.n_embd} wide, {c.n_head} "
        f"heads, vocabulary {c.padded_vocab_size} (padded), {plan.params.total / 1e6:,.1f}M parameters"
        + (" in the stage planned" if plan.stage is not None else ""),
        f"  micro-batch {l_.micro_batch_size} x {c.block_size} tokens, {l_.layout.world_size} process(es), {how}, "
        f"{precision}, {l_.optimizer}, activation checkpointing "
        f"{'on' if l_.activation_checkpointing else 'off'}, accumulation {l_.accumulation}, device {l_.device}",
        f"  activations per layer: {format_gib(plan.activation_per_layer)} (one Block's saved tensors"
        + (", recomputed: only its input is kept" if l_.activation_checkpointing else "") + ")",
    ]
    if plan.stage is not None:
        n = l_.layout.parallelism.pipeline_parallel
        lines.append(f"  pipeline: planned for stage {plan.stage} of {n} (the fuller of the first and the last); the "
                     f"bubble: {n - 1} / ({l_.accumulation} micro-batches + {n - 1}) = {l_.bubble:.0%} of each step "
                     "idle")
    whole = plan_run(c, l_, run) if run is not None else None
    if whole is not None:
        plan = whole.step  # with train.py's process RSS on a CPU
        evaluations = ", ".join(spec.display for spec in run.specs)
        lines.append(f"  evaluation batch {run.eval_batch_size} ({evaluations}); "
                     f"per device, by phase of the run (the peak: {whole.phase}):")
        for name, total in whole.phases.items():
            lowered = whole.settings[name] or "the step's moments: " + ", ".join(
                f"{moment} {t / GiB:.2f}" for moment, t in plan.moments.items())
            lines.append(f"    {name:<16}  {total / GiB:8.2f} GiB  {lowered}")
    items, peak = (whole.items, whole.peak) if whole is not None else (plan.items, plan.peak)
    at = plan.moment if whole is None or whole.phase == "step" else whole.phase
    reserve = whole.reserve if whole is not None else plan.reserve
    lines.append(f"  per device, at the peak ({at}):")
    width = max(len(i.name) for i in items)
    for item in items:
        lines.append(f"    {item.name:<{width}}  {item.bytes / GiB:8.2f} GiB  {item.note}")
    lines.append(f"    {'total':<{width}}  {peak / GiB:8.2f} GiB")
    if reserve:
        lines.append(f"    {'reserve':<{width}}  {reserve / GiB:8.2f} GiB  CUDA context (1 GiB) and allocator "
                     f"slack ({ALLOCATOR_SLACK:.0%} of the total)")
    lines.append(f"    {'device':<{width}}  {device_bytes / GiB:8.2f} GiB  ({device_bytes / GB:g} GB)")
    if whole is None:
        others = ", ".join(f"{name} {t / GiB:.2f} GiB" for name, t in plan.moments.items() if name != plan.moment)
        lines.append(f"  other moments: {others}")
        line = advice(plan.config, plan.launch, device_bytes, spelling)
    else:
        line = run_advice(c, l_, run, device_bytes, spelling)
    spare = device_bytes - peak - reserve
    lines.append("  fits: " + (f"yes, {spare / GiB:.2f} GiB to spare" if line is None else "NO: " + line))
    return "\n".join(lines)
