"""What a launcher tells each of its processes, read once for every entry point (train.py and the evaluations'
command lines): how many processes it started, and whether they must form their group on this CPU.

accelerate's multi-process launcher never passes its config's `use_cpu` to the processes it starts, so under
`accelerate_configs/cpu_2proc.yaml` (or any multi-process config on a machine without CUDA) an Accelerator that is
not told `cpu=True` finds no device to group on, and every process believes it is the only one: each trains, or
evaluates, everything alone. The rule below is the one train.py runs under (`training.distributed.processes`).
"""
from __future__ import annotations

import os

# The variables through which a launcher tells each process its place in a group (torch's env:// rendezvous).
GROUP_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# What a launcher of a group's processes sets beside them: torch's elastic agent (torchrun, and accelerate launch of
# several processes), DeepSpeed's own launcher, SLURM's srun, MPI.
LAUNCHER_MARKS = ("TORCHELASTIC_RUN_ID", "CROSS_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launched_processes() -> int:
    """How many processes the launch started (`WORLD_SIZE`; 1 for a process started alone)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def grouped_on_this_cpu() -> bool:
    """Whether to tell accelerate that this launch runs on the CPU: several processes on a machine without CUDA
    (they then form a gloo group)."""
    import torch

    return launched_processes() > 1 and not torch.cuda.is_available()


def started_by_a_launcher() -> bool:
    """Whether a launcher of a group started this process (`LAUNCHER_MARKS`): only then do RANK and WORLD_SIZE
    describe a group it belongs to."""
    return any(mark in os.environ for mark in LAUNCHER_MARKS)


def leftover_group_variables(command: str) -> str | None:
    """The line for a process that no launcher started but whose environment asks it to join a group (WORLD_SIZE
    above 1, or LOCAL_RANK, which makes accelerate open one): variables left in a shell by another launch. Without
    it the process waits for peers that never come (MASTER_ADDR and MASTER_PORT set) or ends in accelerate's
    traceback. `command`: what to run again once they are unset. None when nothing is left over."""
    env = os.environ
    if started_by_a_launcher():
        return None
    if env.get("WORLD_SIZE", "1").strip() in ("", "0", "1") and "LOCAL_RANK" not in env:
        return None
    found = [name for name in GROUP_VARIABLES if name in env]
    return (f"a launch's variables are left in the environment "
            f"({', '.join(f'{name}={env[name]}' for name in found)}), but no launcher started this process "
            "(torchrun, accelerate launch, srun), so it would wait for peers that never come; "
            f"`unset {' '.join(found)}` and run `{command}` again, or start the processes with accelerate launch")
