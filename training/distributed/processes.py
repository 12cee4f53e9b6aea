"""The processes of a launch: their Accelerator, the batch geometry they share, and agreement on errors.

Without the agreement, a rank that finds a problem (a damaged file, unreadable data) exits while the others wait in
their next collective until a timeout. The user then reads a timeout traceback instead of the problem.
"""
from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import ProjectConfiguration, gather_object

from common.errors import UserError
from common.launch import grouped_on_this_cpu, leftover_group_variables
from common.run_dir import RunDir
from configs import TrainingConfig
from training.distributed.engines import (
    check_engine,
    check_world_size,
    deepspeed_missing,
    refuse_engine_on_cpu,
    requested_engine,
)
from training.distributed.machine import check_launch


@dataclass(frozen=True)
class BatchGeometry:
    """How one optimizer step's batch is cut: micro_batch_size x block_size tokens per forward, on each of
    world_size processes, accumulation times."""

    micro_batch_size: int
    block_size: int
    world_size: int
    accumulation: int

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch_size * self.block_size * self.world_size * self.accumulation

    @classmethod
    def of_launch(cls, cfg: TrainingConfig, block_size: int, data_parallel_size: int | None = None) -> BatchGeometry:
        """This launch's geometry for `--total_batch_size`, known before any Accelerator. `data_parallel_size` counts
        the ranks that read different batches; it defaults to every process."""
        world = process_state().num_processes if data_parallel_size is None else data_parallel_size
        try:
            return cls.for_total(cfg.total_batch_size, cfg.micro_batch_size, block_size, world)
        except UserError as err:
            if data_parallel_size is None or data_parallel_size == process_state().num_processes:
                raise
            raise UserError(f"{err} (the processes that read different batches: one per tensor-parallel group)"
                            ) from None

    @staticmethod
    def divides(total_batch_size: int, micro_batch_size: int, block_size: int, world_size: int) -> bool:
        """Whether some accumulation makes `total_batch_size` tokens per step from these micro-batches. `for_total`
        enforces it, and the memory planner's advice follows it."""
        return total_batch_size % (micro_batch_size * block_size * world_size) == 0

    @classmethod
    def for_total(cls, total_batch_size: int, micro_batch_size: int, block_size: int,
                  world_size: int) -> BatchGeometry:
        """The accumulation that makes `total_batch_size` tokens per step; a UserError when none does."""
        per_micro_step = micro_batch_size * block_size * world_size
        if not cls.divides(total_batch_size, micro_batch_size, block_size, world_size):
            raise UserError(
                f"total_batch_size {total_batch_size} is not a multiple of micro_batch_size x block_size x processes "
                f"= {micro_batch_size} x {block_size} x {world_size} = {per_micro_step}; change one of them")
        return cls(micro_batch_size, block_size, world_size, total_batch_size // per_micro_step)


def process_state(**process_group: Any) -> PartialState:
    """This process's place in the launch, before any Accelerator exists, so the batch geometry is known first.

    A multi-process DDP launch without CUDA runs on gloo; otherwise every process would think it is rank 0. A launch
    whose ranks still come up alone is refused. The first call opens the group with `process_group`, the keyword
    arguments of `init_process_group` (`training.distributed.elastic`). A group's variables left over in the
    environment of a process no launcher started are one line, before accelerate waits or fails on them."""
    if (leftover := leftover_group_variables("python train.py")) is not None:
        raise UserError(leftover)
    if (missing := deepspeed_missing()) is not None:
        raise UserError(missing)
    check_launch()  # a launch this machine cannot run is one line
    refuse_engine_on_cpu()  # accelerate would train DDP instead
    state = PartialState(cpu=_cpu_launch(), **process_group)
    check_world_size(int(os.environ.get("WORLD_SIZE", "1")), state.num_processes)
    return state


def _cpu_launch() -> bool:
    """Whether to tell accelerate that a launch runs on the CPU: a multi-process launch on a machine without CUDA
    (`common.launch`, the rule the evaluations' command lines share), unless its config asks for an engine, which
    accelerate would then silently replace by DDP (the engine's own launch is left to accelerate, and checked:
    `training.distributed.engines`)."""
    return grouped_on_this_cpu() and requested_engine() == "ddp"


def start_accelerator(accumulation: int, trackers: list[str] | None, run: RunDir) -> Accelerator:
    """This process's Accelerator. Devices, precision, compile and the engine come from accelerate's config; the
    micro-steps per step from the batch geometry. Trackers write into the run folder. On a CPU, freed activation
    memory goes back to the OS and large tensors get huge pages (see below)."""
    accelerator = Accelerator(cpu=_cpu_launch(), gradient_accumulation_steps=accumulation, log_with=trackers,
                              project_config=ProjectConfiguration(str(run.path), logging_dir=str(run.tensorboard)))
    check_engine(accelerator)  # the engine the config asked for, not accelerate's silent fallback
    if accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if accelerator.device.type == "cpu":
        return_freed_memory_to_the_os()
        use_transparent_huge_pages()
    return accelerator


# glibc's mallopt parameters (malloc.h): the size from which an allocation gets its own mmap, and how much free
# memory at the top of the heap is kept for reuse.
M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = -3, -1
# From this size on a CPU allocation is its own mmap, given back when freed: GPT-2-sized activations (12-100 MB).
# Smaller ones (the default run's, at most 2 MiB) come from the heap. There up to HEAP_KEPT_BYTES of freed memory
# stays for the next micro-step, instead of being unmapped, faulted in and zeroed again. Setting the first threshold
# would otherwise set the second to 128 KiB.
MMAP_THRESHOLD_BYTES = 4 << 20
HEAP_KEPT_BYTES = 64 << 20


def return_freed_memory_to_the_os() -> bool:
    """Give every allocation of `MMAP_THRESHOLD_BYTES` or more its own mmap, returned to the OS when freed, and keep
    at most `HEAP_KEPT_BYTES` of the heap's free memory. glibc only; elsewhere it returns False and changes nothing.

    glibc's default threshold rises to the largest block freed so far. Activation-sized tensors then come from the
    heap, which keeps what they free, so resident memory grows block after block of the backward. A fixed threshold
    cuts GPT-2's peak by over a third (docs/benchmarks.md, "Activation checkpointing"). The numbers stay the same, bit
    for bit."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl)
        return False
    return (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            and libc.mallopt(M_TRIM_THRESHOLD, HEAP_KEPT_BYTES) == 1)


# The kernel's transparent huge page mode: "[always]" or "[madvise]" lets a process ask for 2 MiB pages.
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def use_transparent_huge_pages() -> bool:
    """Ask torch's CPU allocator for 2 MiB pages for allocations of 2 MiB or more, where the kernel allows it.
    Returns whether it is on; a user's own `THP_MEM_ALLOC_ENABLE` is kept.

    Every mmapped tensor is faulted in page by page at its first write. 2 MiB pages cut the default run's page faults
    eightfold (docs/benchmarks.md, "The embedded default run")."""
    try:
        with open(_THP_MODE) as f:
            allowed = "[never]" not in f.read()
    except OSError:  # not Linux, or no THP support
        return False
    if allowed:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return allowed and os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"


def close_process_group() -> None:
    """Close the launch's process group, if one is open. A process that stops on an error with its gloo group open
    sometimes aborts at exit (SIGABRT instead of status 2)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


_FLAGS_GROUP: list = []  # the gloo group that `any_rank` agrees through, made at its first use


def any_rank(flag: bool, accelerator: Accelerator) -> bool:
    """Whether `flag` holds on any rank, answered alike on every rank. Call on every rank.

    The ranks sum their flags in an all-reduce of a host tensor over gloo, which never waits for a GPU. Under NCCL
    that is a gloo group of its own, made by every rank at the first call."""
    if accelerator.num_processes == 1:
        return flag
    if not _FLAGS_GROUP:
        gloo = torch.distributed.get_backend() == "gloo"
        _FLAGS_GROUP.append(torch.distributed.group.WORLD if gloo else torch.distributed.new_group(backend="gloo"))
    count = torch.tensor([int(flag)], dtype=torch.int32)
    torch.distributed.all_reduce(count, group=_FLAGS_GROUP[0])
    return bool(count.item())


@contextmanager
def shared_across_ranks(accelerator: Accelerator) -> Iterator[None]:
    """Run a block on every rank. If it raised a `UserError` on any rank, raise the lowest rank's message on every
    rank, printed once. The block must not run collectives: a rank that failed early would not join them."""
    error: UserError | None = None
    try:
        yield
    except UserError as err:
        error = err
    if accelerator.num_processes == 1:
        if error is not None:
            raise error
        return
    messages = [m for m in gather_object([None if error is None else str(error)]) if m is not None]
    if messages:
        raise UserError(messages[0], on_every_rank=True) from error
