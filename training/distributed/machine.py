"""Every launch says what it runs, or refuses: what an accelerate launch asks of this machine (processes, devices,
precision) against what the machine gives. One rule for every accelerate config.

accelerate silently replaces what a machine cannot give. `accelerate launch --cpu --num_processes 2` starts one
process; fp16 on a CPU trains in fp32; an FSDP or DeepSpeed config without a GPU brings every rank up alone; a GPU
config on a machine without one runs on the CPU. The rule:

- what this machine cannot give is refused in one line before anything is built (`REFUSALS`, read by
  `check_launch` at the start of every run);
- what it gives otherwise than a GPU config says (gloo, bf16 or torch.compile on the CPU) runs, and the run header
  says so on a line of its own (`runs_here`).

The engines' other fallbacks stay in `training.distributed.engines`: an FSDP or DeepSpeed config with `use_cpu`,
and the backstop for ranks that still come up alone. A ZeRO config on an install without DeepSpeed never reaches
train.py: accelerate's launcher stops it (docs/faults.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from common.engine_names import DDP, FAMILY_NAMES, FSDP
from common.errors import UserError
from common.parallelism import Degree
from training.distributed.engines import CPU_FIX, requested_engine


@dataclass(frozen=True)
class Asked:
    """What a launch asks for, as accelerate's launcher tells each process.

    `processes` is WORLD_SIZE (1 for a process started alone), `per_machine` those on this machine.
    `several_in_one` means accelerate's single-process launcher was asked for more than one, and started one.
    `cpu` is `--cpu` / ACCELERATE_USE_CPU, which the multi-process launcher never passes on (cpu_2proc.yaml's
    `use_cpu` reaches no process)."""

    processes: int = 1
    per_machine: int = 1
    several_in_one: bool = False
    engine: str = DDP
    precision: str = "no"
    compile: str = "no"
    cpu: bool = False

    @classmethod
    def of_environment(cls) -> Asked:
        env = os.environ
        launched = "WORLD_SIZE" in env
        # Only accelerate's simple launcher sets ACCELERATE_USE_CPU without a WORLD_SIZE, and it sets MASTER_PORT
        # only when told to start more than one process (its prepare_simple_launcher_cmd_env).
        several_in_one = not launched and "ACCELERATE_USE_CPU" in env and "MASTER_PORT" in env
        processes = int(env.get("WORLD_SIZE", "1"))
        return cls(processes, int(env.get("LOCAL_WORLD_SIZE", processes)), several_in_one, requested_engine(),
                   env.get("ACCELERATE_MIXED_PRECISION", "no").lower(),
                   env.get("ACCELERATE_DYNAMO_BACKEND", "no").lower(),
                   env.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes"))


@dataclass(frozen=True)
class Machine:
    """What this machine gives: its GPUs and CPU cores."""

    gpus: int
    cores: int

    @classmethod
    def this(cls) -> Machine:
        return cls(torch.cuda.device_count() if torch.cuda.is_available() else 0, os.cpu_count() or 1)


_SEVERAL_FIX = ("launch several with --config_file accelerate_configs/cpu_2proc.yaml, or --multi_gpu --num_processes "
                "N without --cpu (train.py puts them on the CPU by itself); if MASTER_PORT comes from your own "
                "environment, unset it")


def accelerate_runs_engines(machine: Machine) -> bool:
    """Whether accelerate runs FSDP and DeepSpeed on `machine`: on GPUs only. Without one it brings every rank up
    alone (docs/engines.md, "What the engines do on a CPU"). tests/engine_shim.py patches this to run them on a
    CPU."""
    return machine.gpus > 0


def engine_without_a_gpu(asked: Asked, machine: Machine) -> bool:
    """The launch asks for FSDP or DeepSpeed, which accelerate does not run on `machine` (no GPU)."""
    return asked.engine != DDP and not accelerate_runs_engines(machine)


# What a machine cannot give, as (when, the line), checked in order; the first that applies is said. `{engine}` in
# a line is the engine's family name.
REFUSALS: tuple[tuple[Callable[[Asked, Machine], bool], str], ...] = (
    (engine_without_a_gpu,
     f"the accelerate config asks for {{engine}}, and this machine has no GPU; {CPU_FIX}"),
    (lambda asked, machine: asked.several_in_one,
     "accelerate launch started 1 process where several were asked (accelerate's single-process launcher, which "
     "--cpu and a config without a multi-process distributed_type pick, starts one whatever --num_processes "
     f"says); {_SEVERAL_FIX}"),
    (lambda asked, machine: asked.precision == "fp16" and machine.gpus == 0,
     "the launch asks for fp16 mixed precision, which needs a GPU and this machine has none (accelerate would train "
     "in fp32 without saying); pass --mixed_precision no (or bf16) to accelerate launch"),
)


def refusal(asked: Asked, machine: Machine) -> str | None:
    """The one line for what `machine` cannot give of `asked`, or None where it gives all."""
    return next((line.format(engine=FAMILY_NAMES[asked.engine]) for applies, line in REFUSALS
                 if applies(asked, machine)), None)


def trains_on(asked: Asked, machine: Machine) -> str | None:
    """The device launch `asked` trains on, on `machine`, for `train.py --plan`: "cpu" where it asks for the CPU or
    there is no GPU, else "cuda". None for an FSDP or DeepSpeed launch without a GPU, which is refused."""
    if engine_without_a_gpu(asked, machine):
        return None
    return "cpu" if asked.cpu or not machine.gpus else "cuda"


def runs_here(asked: Asked, machine: Machine) -> str | None:
    """The header's line on what runs on a machine without a GPU, where the launch asks for more than one plain
    process: several processes, mixed precision, compilation. None on a GPU machine, and for a plain run."""
    if machine.gpus:
        return None
    parts = []
    if asked.processes > 1:
        crowded = (f", {asked.per_machine} processes on this machine's {machine.cores} cores"
                   if asked.per_machine > machine.cores else "")
        parts.append(f"{asked.processes} processes on the CPU over gloo{crowded}")
    if asked.precision == "bf16":
        parts.append("bf16 on the CPU")
    if asked.compile != "no":
        parts.append(f"torch.compile ({asked.compile}) on the CPU")
    return f"no GPU on this machine: {', '.join(parts)}" if parts else None


def check_launch(asked: Asked | None = None, machine: Machine | None = None) -> None:
    """Refuse in one line a launch this machine cannot give (`REFUSALS`); call before anything is built."""
    if (line := refusal(asked or Asked.of_environment(), machine or Machine.this())) is not None:
        raise UserError(line)


def degree_here(asked: str, degree: Degree, machine: Machine) -> str | None:
    """The line for a degree that runs on FSDP2 (`--tensor_parallel`), asked under another engine on a machine
    without a GPU; None on a GPU machine. FSDP2 runs on GPUs only, so no launch here runs it. The support table's
    advice would send the user round in a circle."""
    if machine.gpus or degree.engine != FSDP:
        return None
    return (f"{asked} needs accelerate's FSDP2 plugin, which runs on GPUs, and this machine has none: no launch here "
            f"runs it; leave out {degree.flag} (accelerate_configs/cpu_2proc.yaml trains the rest of the run on this "
            "CPU), or launch on GPUs with accelerate_configs/fsdp_8gpu.yaml")
