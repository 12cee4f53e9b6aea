"""What a launcher tells each of its processes, read once for every entry point (train.py and the evaluations'
command lines): how many processes it started, and whether they must form their group on this CPU.

accelerate's multi-process launcher never passes its config's `use_cpu` to the processes it starts, so under
`accelerate_configs/cpu_2proc.yaml` (or any multi-process config on a machine without CUDA) an Accelerator that is
not told `cpu=True` finds no device to group on, and every process believes it is the only one: each trains, or
evaluates, everything alone. The rule below is the one train.py runs under (`training.distributed.processes`).
"""
from __future__ import annotations

import os


def launched_processes() -> int:
    """How many processes the launch started (`WORLD_SIZE`; 1 for a process started alone)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def grouped_on_this_cpu() -> bool:
    """Whether to tell accelerate that this launch runs on the CPU: several processes on a machine without CUDA
    (they then form a gloo group)."""
    import torch

    return launched_processes() > 1 and not torch.cuda.is_available()
