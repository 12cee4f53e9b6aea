"""What to change when a plan does not fit: the largest micro-batch that does, and the one setting to change.

The setting is a micro-batch the run accepts, FSDP2, activation checkpointing, or more devices.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from common.engine_names import FSDP
from model.config import GPTConfig
from planner.launch import GB, Launch
from planner.memory import CPU_PROCESS_BYTES, RunPhases, format_gib, plan_memory, plan_run, run_process_bytes
from training.distributed.layout import Layout
from training.distributed.processes import BatchGeometry


def resized(config: GPTConfig, launch: Launch, micro_batch_size: int, processes: int | None = None) -> Launch | None:
    """`launch` at another micro-batch (and number of processes).

    With a fixed total batch, only a micro-batch the run accepts (`BatchGeometry`'s rule), at its accumulation.
    None for one the run would refuse."""
    layout = launch.layout if processes is None else replace(launch.layout, world_size=processes)
    if launch.total_batch_size is None:
        return replace(launch, micro_batch_size=micro_batch_size, layout=layout)
    data_parallel = layout.data_parallel_size  # the ranks reading other batches: a TP group or a pipeline reads one
    if layout.world_size % layout.parallelism.model_parallel or not BatchGeometry.divides(
            launch.total_batch_size, micro_batch_size, config.block_size, data_parallel):
        return None
    geometry = BatchGeometry.for_total(launch.total_batch_size, micro_batch_size, config.block_size, data_parallel)
    return replace(launch, micro_batch_size=micro_batch_size, layout=layout, accumulation=geometry.accumulation)



def largest_micro_batch(config: GPTConfig, launch: Launch, device_bytes: int, limit: int = 1024,
                        process_bytes: int = CPU_PROCESS_BYTES) -> int:
    """The largest micro-batch (<= limit) the run accepts whose plan fits in `device_bytes`; 0 when none does.

    Every candidate is planned, from the largest down: the peak is not monotone. With a fixed total batch, the
    accumulation changes with the micro-batch. So does whether gradients are held between micro-steps.
    `process_bytes` is the process's own RSS on a CPU, as `plan_memory` counts it."""
    for micro_batch_size in range(limit, 0, -1):
        candidate = resized(config, launch, micro_batch_size)
        if candidate is not None and plan_memory(config, candidate, process_bytes).fits(device_bytes):
            return micro_batch_size
    return 0



@dataclass(frozen=True)
class Spelling:
    """How an entry point names the settings in its advice, and whether it may advise a sharding engine.

    `sharding` is False for a CPU that runs no such engine (`machine.accelerate_runs_engines`). That is train.py
    --plan on a machine without a GPU."""

    micro_batch: str = "--micro_batch_size"
    fsdp: str = "--fsdp"
    checkpointing: str = "--activation_checkpointing"
    processes: str = "--processes"
    sharding: bool = True

    def engine(self, layout: Layout) -> str:
        """How the advice names the sharded engine of `layout`.

        FSDP2 is named by the setting that launches it (`fsdp`). DeepSpeed is named; the launch keeps its config."""
        return self.fsdp if layout.parallelism.kind == FSDP else layout.describe()



def advice(config: GPTConfig, launch: Launch, device_bytes: int, spelling: Spelling = Spelling(),
           process_bytes: int = CPU_PROCESS_BYTES) -> str | None:
    """None when the plan fits; else one line: what does not fit and the one setting to change. `process_bytes`: the
    process's own RSS on a CPU (a bare step's by default; `run_advice` gives train.py's, so that the line states the
    table's total)."""
    plan = plan_memory(config, launch, process_bytes)
    if plan.fits(device_bytes):
        return None
    where = f"needs {format_gib(plan.peak + plan.reserve)} per device, more than the {device_bytes / GB:g} GB device"
    B = launch.micro_batch_size
    if (mb := largest_micro_batch(config, launch, device_bytes, B - 1, process_bytes)) > 0:
        return f"micro-batch {B} {where}; lower {spelling.micro_batch} to {mb} (the batch keeps its tokens " \
               "through more accumulation)"
    if not launch.activation_checkpointing:
        checkpointed = replace(launch, activation_checkpointing=True)
        if (mb := largest_micro_batch(config, checkpointed, device_bytes, B, process_bytes)) > 0:
            return f"micro-batch {B} {where}; add {spelling.checkpointing}" + \
                   (f" (it fits then at micro-batch {B})" if mb == B else f" and lower {spelling.micro_batch} to {mb}")
    layout = launch.layout
    if launch.device == "cpu" and not spelling.sharding:
        return _cpu_advice(config, launch, device_bytes, spelling, where, process_bytes)
    if layout.full_replicas and launch.optimizer_shards:
        for checkpointing in (launch.activation_checkpointing, True):
            sharded = replace(launch, layout=layout.sharded(), activation_checkpointing=checkpointing)
            if (mb := largest_micro_batch(config, sharded, device_bytes, B, process_bytes)) > 0:
                extra = "" if checkpointing == launch.activation_checkpointing else f" and {spelling.checkpointing}"
                return f"micro-batch {B} {where}; shard it with {spelling.fsdp}{extra}" + \
                       ("" if mb == B else f", at {spelling.micro_batch} {mb}")
    if not launch.optimizer_shards and layout.world_size > 1:
        return f"micro-batch {B} {where}, even at micro-batch 1; use --optimizer adamw with {spelling.fsdp} " \
               f"({launch.optimizer_spec.display} is refused under FSDP)"
    if layout.parallelism.pipelined:  # more stages: each holds fewer blocks
        more, doubled = 2 * layout.parallelism.pipeline_parallel, 2 * layout.world_size
        staged = Layout(doubled, layout.parallelism.with_sizes(pipeline_parallel=more))
        candidate = resized(config, replace(launch, layout=staged), B) if more <= config.n_layer else None
        fits = candidate is not None and plan_memory(config, candidate, process_bytes).fits(device_bytes)
        return f"micro-batch {B} {where}, even at micro-batch 1" + (
            f"; split it into {more} stages (--pipeline_parallel {more}, {doubled} processes)"
            if fits else "; use a larger device")
    # More devices under the launch's own sharding engine (FSDP2 for DDP and one process).
    sharded = replace(launch, layout=layout.sharded(), activation_checkpointing=True)

    def fits_on(processes: int) -> bool:
        candidate = resized(config, sharded, 1, processes)
        return candidate is not None and plan_memory(config, candidate, process_bytes).fits(device_bytes)

    devices = next((n for n in (2**k for k in range(1, 11)) if n > layout.world_size and fits_on(n)), None)
    return f"micro-batch {B} {where}, even at micro-batch 1 with {spelling.checkpointing}" + \
           (f" and {layout.describe()}" if layout.sharded() == layout else "") + \
           (f"; shard it with {spelling.engine(sharded.layout)} over {devices} devices ({spelling.processes} "
            f"{devices})" if devices and launch.optimizer_shards else "; use a larger device")



def _cpu_advice(config: GPTConfig, launch: Launch, device_bytes: int, spelling: Spelling, where: str,
                process_bytes: int) -> str:
    """What is left to advise a CPU launch that fits at no micro-batch, where no engine shards (`advice`).

    Its processes share this machine's memory; `device_bytes` is each one's share. So more processes bring no more
    memory, and fewer bring more to each. The advice is one process, if it then fits. Else the run needs more
    memory than this machine has."""
    B, layout = launch.micro_batch_size, launch.layout
    if layout.world_size > 1 and layout.parallelism.model_parallel == 1:
        for checkpointing in (launch.activation_checkpointing, True):
            alone = resized(config, replace(launch, activation_checkpointing=checkpointing), B, 1)
            mb = largest_micro_batch(config, alone, device_bytes * layout.world_size, B, process_bytes) if alone else 0
            if mb > 0:
                return (f"micro-batch {B} {where}, even at micro-batch 1; its {layout.world_size} processes share "
                        "this machine's memory: train it as one process (python train.py, no accelerate launch)"
                        + ("" if checkpointing == launch.activation_checkpointing else
                           f" with {spelling.checkpointing}")
                        + ("" if mb == B else f" at {spelling.micro_batch} {mb}"))
    return (f"micro-batch {B} {where}, even at micro-batch 1 with {spelling.checkpointing}; it needs more memory than "
            "this machine has (FSDP and DeepSpeed, which would shard it, run on GPUs)")


def run_advice(config: GPTConfig, launch: Launch, run: RunPhases, device_bytes: int,
               spelling: Spelling = Spelling()) -> str | None:
    """None when every phase of the run fits. Else one line: the phase that decides the peak, and what lowers it.

    The step: its own advice (`advice`). An evaluation: a smaller --eval_batch_size. The Hub staging: staging only
    the final model. A save or the export: the weights themselves decide, so sharding or a larger device."""
    plan = plan_run(config, launch, run)
    if plan.fits(device_bytes):
        return None
    phase = plan.phase
    where = (f"the {phase} needs {format_gib(plan.peak + plan.reserve)} per device, more than the "
             f"{device_bytes / GB:g} GB device")
    process = run_process_bytes(launch, run)
    if phase == "step":
        return advice(config, launch, device_bytes, spelling, process)
    if plan.settings[phase] == "--eval_batch_size":
        smaller = next((b for b in range(run.eval_batch_size - 1, 0, -1)
                        if plan_run(config, launch, replace(run, eval_batch_size=b)).fits(device_bytes)), 0)
        if smaller:
            return f"{where}; lower --eval_batch_size to {smaller} (now {run.eval_batch_size})"
    if phase == "Hub staging":
        return f"{where}; push only the final model (--hub_push_every 0)"
    step_line = advice(config, launch, device_bytes, spelling, process)
    if step_line is not None:  # what the step's advice changes (sharding, more devices) lowers what is kept too
        return f"{where}, and the step does not fit either: {step_line}"
    return f"{where} (the weights and optimizer state every rank keeps)" + \
        (f"; shard them with {spelling.fsdp}" if launch.layout.full_replicas and spelling.sharding else
         "; it needs more memory than this machine has" if launch.device == "cpu" else "; use a larger device")
