"""The memory planner: how much memory one training process needs, from the model's shapes and the launch's layout.

Nothing is allocated. Each module imports only those before it:
    launch  -> what a process does with the model (`Launch`, `Shards`), from the run's `Layout`
    memory  -> the per-process plan of a step and of every phase of a run (`plan_memory`, `plan_run`)
    advice  -> the one setting to change when it does not fit
    render  -> the table
    cli     -> `train.py --plan` (`exit_after_plan`), and the sizes and device `benchmarks.memory_plan` plans for

The planner sits above `training/`: it reads the layout, the optimizer plan, the batch geometry and the support
table there. Nothing in `training/` imports it.
"""
from planner.advice import Spelling, advice, largest_micro_batch, resized, run_advice
from planner.cli import (
    DEFAULT_DEVICE_GB,
    device_here,
    exit_after_plan,
    launch_environment,
    machine_memory,
    model_config,
)
from planner.launch import DEVICES, DTYPES, GB, OPTIMIZERS, GiB, Launch, Shards
from planner.memory import (
    CPU_PROCESS_BYTES,
    Item,
    MemoryPlan,
    ParamCounts,
    RunPhases,
    RunPlan,
    activation_bytes_per_layer,
    evaluation_bytes,
    plan_memory,
    plan_run,
)
from planner.render import render

__all__ = ["CPU_PROCESS_BYTES", "DEFAULT_DEVICE_GB", "DEVICES", "DTYPES", "GB", "GiB", "Item", "Launch",
           "MemoryPlan", "OPTIMIZERS", "ParamCounts", "RunPhases", "RunPlan", "Shards", "Spelling",
           "activation_bytes_per_layer", "advice", "device_here", "evaluation_bytes", "exit_after_plan",
           "largest_micro_batch", "launch_environment", "machine_memory", "model_config", "plan_memory", "plan_run",
           "render", "resized", "run_advice"]
