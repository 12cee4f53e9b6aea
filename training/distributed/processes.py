"""The processes of a launch: their Accelerator, the batch geometry they share, and agreement on errors.

Without the agreement, a rank that finds a problem (a damaged file of its own, a data source it cannot
read) exits while the others wait for it in their next collective until a timeout, and the user reads a
distributed-timeout traceback instead of the problem.
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
from common.launch import grouped_on_this_cpu
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
    """How one optimizer step's batch is cut: micro_batch_size x block_size tokens per forward pass, on each of
    world_size processes, accumulation times. Their product is the step's batch in tokens."""

    micro_batch_size: int
    block_size: int
    world_size: int
    accumulation: int

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch_size * self.block_size * self.world_size * self.accumulation

    @classmethod
    def of_launch(cls, cfg: TrainingConfig, block_size: int, data_parallel_size: int | None = None) -> BatchGeometry:
        """The geometry of this launch (its world size is known before any Accelerator) for `--total_batch_size`.
        `data_parallel_size`: the ranks that read different batches, under tensor parallelism fewer than the
        processes (`training.distributed.tensor_parallel`); default: every process."""
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
        """Whether some accumulation makes `total_batch_size` tokens per step from these micro-batches (the rule
        `for_total` enforces, and the memory planner's advice follows)."""
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
    """This process's place in the launch, before any Accelerator exists (so that the batch geometry is known
    first). A multi-process DDP launch on a machine without CUDA runs on gloo; otherwise every process would
    believe it is rank 0. A launch whose ranks still come up alone (a DeepSpeed or FSDP config without a device
    for it) is refused (`training.distributed.engines.check_world_size`). `process_group`: `init_process_group`'s
    keyword
    arguments (`training.distributed.elastic`), used by the first call, which opens the group."""
    if (missing := deepspeed_missing()) is not None:
        raise UserError(missing)
    check_launch()  # what this machine cannot give of the launch: one line (training.distributed.machine)
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
    """The Accelerator of this process: devices, precision, compile and the engine (DDP, FSDP, DeepSpeed) come
    from accelerate's config,
    micro-steps per optimizer step from the batch geometry, trackers (`--report_to`) write into the run folder. On a
    CPU, glibc's mmap threshold is fixed so that freed activation memory goes back to the OS, and large tensors get
    huge pages (see below)."""
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
# memory at the top of the heap is kept for reuse instead of being given back at once.
M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = -3, -1
# From this size on, a CPU allocation is its own mmap, given back when freed: GPT-2-sized activations (12-100 MB).
# Smaller ones, such as a small model's (the default run's are at most 2 MiB), come from the heap, where up to
# HEAP_KEPT_BYTES of freed memory stays for the next micro-step instead of being unmapped, faulted in and zeroed
# again every time (fixing the first threshold sets the second to 128 KiB otherwise).
MMAP_THRESHOLD_BYTES = 4 << 20
HEAP_KEPT_BYTES = 64 << 20


def return_freed_memory_to_the_os() -> bool:
    """Give every allocation of `MMAP_THRESHOLD_BYTES` or more its own mmap, returned to the OS when freed, and keep
    at most `HEAP_KEPT_BYTES` of the heap's free memory (glibc only; False elsewhere, where nothing changes). glibc's
    default threshold rises to the largest block freed so far (up to 32 MiB), after which a CPU step's
    activation-sized tensors come from its heap, which keeps the memory they free: resident memory then grows block
    after block of the backward. GPT-2 124M, one step of 8 x 1,024 tokens with activation checkpointing: peak RSS
    3.8-4.1 GiB with the default, 2.5 GiB with a fixed threshold (docs/benchmarks.md). Allocations and arithmetic
    are unchanged: the same numbers, bit for bit."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl)
        return False
    return (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            and libc.mallopt(M_TRIM_THRESHOLD, HEAP_KEPT_BYTES) == 1)


# The kernel's transparent huge page mode: "[always]" or "[madvise]" lets a process ask for 2 MiB pages.
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def use_transparent_huge_pages() -> bool:
    """Ask torch's CPU allocator for 2 MiB pages for its allocations of 2 MiB or more (`THP_MEM_ALLOC_ENABLE`, read
    at each allocation), where the kernel allows it; a user's own setting of the variable is kept. Every mmapped
    tensor is faulted in page by page at its first write: with 4 KiB pages the default run took 3.6 million page
    faults in 25 steps (its loss buffer alone is 100 MB per micro-step), with 2 MiB pages 0.45 million, and 6 s less
    system time (docs/benchmarks.md). Returns whether it is on."""
    try:
        with open(_THP_MODE) as f:
            allowed = "[never]" not in f.read()
    except OSError:  # not Linux, or no THP support
        return False
    if allowed:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return allowed and os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"


def close_process_group() -> None:
    """Close the launch's process group, if one is open. A process that stops on an error with its gloo group
    open aborts now and then at exit (SIGABRT instead of status 2); a no-op after `end_training` closed it."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


_FLAGS_GROUP: list = []  # the gloo group that `any_rank` agrees through, made at its first use


def any_rank(flag: bool, accelerator: Accelerator) -> bool:
    """Whether `flag` holds on any rank, answered alike on every rank; call on every rank. One process answers from
    its own flag. Several sum theirs in an all-reduce of a host tensor over gloo, which never waits for a GPU: a
    group of its own where the run's collectives are NCCL's (made by every rank at the first call)."""
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
    """Run a block on every rank; if it raised a `UserError` on any rank, raise the first (lowest rank's)
    message on every rank, marked for printing once. The block must not run collectives itself (a rank that
    failed early would not join them)."""
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
