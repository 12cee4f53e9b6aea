"""The launch's parallel layout, one object: how many processes, the engine that holds the model (DDP, FSDP2 or
DeepSpeed ZeRO-n, from the accelerate config) and how the processes share the work (tensor-parallel groups,
data-parallel ranks; room for pipeline and context degrees).

train.py builds it first, from the accelerate launch's environment and `--tensor_parallel`, before any Accelerator
exists; once the Accelerator runs, `running` confirms it against what accelerate brought up. The batch geometry, the
refusals, the run header, the checkpoint record (`Layout.engine`), the tensor-parallel split and the memory planner
all read it; nothing else derives a degree or a world size from the flags or the environment.

The degrees multiply to the world: world_size = data_parallel_size x tensor_parallel (x pipeline_parallel, 1 until
pipeline parallelism lands). The tensor-parallel dimension is innermost: ranks r and r + 1 of a degree-2 launch are
one group, and rank r's data-parallel rank is r // tensor_parallel.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from accelerate import Accelerator

from common.errors import UserError
from model.tensor_parallel import split_problem
from training.engines import Engine, launch_engine
from training.machine import Machine, tensor_parallel_here
from training.processes import process_state
from training.support import DDP, FSDP, refusal


@dataclass(frozen=True)
class Layout:
    """`world_size` processes; the engine (`kind` "ddp", "fsdp" or "deepspeed", DeepSpeed's `zero_stage`); groups of
    `tensor_parallel` ranks that split each block's matrices (1: none); `pipeline_parallel` stages (1: none yet)."""

    world_size: int = 1
    kind: str = DDP
    zero_stage: int = 0
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    @property
    def data_parallel_size(self) -> int:
        """The ranks that read different batches (and over which FSDP2 shards): every process, or one per group."""
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)

    def data_parallel_rank(self, rank: int) -> int:
        """The data-parallel rank (which batches it reads) of process `rank`."""
        return rank // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def engine(self) -> Engine:
        """The engine with its tensor-parallel degree: the refusals' subject and what a checkpoint records."""
        return Engine(self.kind, self.zero_stage, self.tensor_parallel)

    @property
    def name(self) -> str:
        return self.engine.name

    @classmethod
    def of_launch(cls, tensor_parallel: int, n_head: int | None = None, n_embd: int | None = None,
                  world_size: int | None = None) -> Layout:
        """This launch's layout, from accelerate's environment (processes, engine) and `--tensor_parallel`, refused
        in one line when the launch cannot run it or (shapes given: from scratch, the flags give them) the model
        cannot be split; call before anything is built. `world_size`: default, the process group's (which it
        joins: `training.processes.process_state`); `--plan` passes the launch's WORLD_SIZE and joins none."""
        engine = launch_engine()
        world = process_state().num_processes if world_size is None else world_size
        layout = cls.checked(world, engine.kind, engine.zero_stage, tensor_parallel, Machine.this())
        if n_head is not None and n_embd is not None:
            layout.check_model(n_head, n_embd)
        return layout

    @classmethod
    def checked(cls, world_size: int, kind: str, zero_stage: int = 0, tensor_parallel: int = 1,
                machine: Machine | None = None) -> Layout:
        """The layout, or a one-line UserError when it is not one train.py runs. `machine`: the one the launch runs
        on, where known (without a GPU no launch runs tensor parallelism, and the line says so)."""
        layout = cls(world_size, kind, zero_stage, tensor_parallel)
        if tensor_parallel == 1:
            return layout
        if kind != FSDP:
            if machine is not None and (line := tensor_parallel_here(tensor_parallel, machine)):
                raise UserError(line)
            raise UserError(refusal("--tensor_parallel", kind, zero_stage,
                                    asked=f"--tensor_parallel {tensor_parallel}"))
        if tensor_parallel < 1 or world_size % tensor_parallel:
            raise UserError(f"--tensor_parallel {tensor_parallel} needs a multiple of {tensor_parallel} processes, "
                            f"this launch has {world_size}; launch "
                            f"{max(tensor_parallel, world_size // tensor_parallel * tensor_parallel)} processes "
                            f"(--num_processes), or pass a --tensor_parallel that divides {world_size}")
        return layout

    def check_model(self, n_head: int, n_embd: int) -> None:
        """A model whose heads or MLP width the tensor-parallel degree does not divide, refused in one line."""
        degree = self.tensor_parallel
        if degree > 1 and (problem := split_problem(n_head, n_embd, degree)) is not None:
            divisors = [d for d in range(1, n_head + 1) if split_problem(n_head, n_embd, d) is None]
            raise UserError(f"--tensor_parallel {degree} cannot split this model: {problem}; pass one of "
                            f"{', '.join(map(str, divisors))}")

    def running(self, accelerator: Accelerator) -> Layout:
        """The layout as accelerate runs it: the engine's kind was checked when the Accelerator started
        (`training.engines.check_engine`); DeepSpeed's ZeRO stage is read from its plugin."""
        running = Engine.of(accelerator)
        return replace(self, kind=running.kind, zero_stage=running.zero_stage)
