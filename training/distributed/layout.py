"""The launch's parallel layout, one object: the number of processes and the launch's parallelism (the engine that
holds the model, and the degrees that split it: `common.parallelism.Parallelism`), hence how the processes share the
work (tensor-parallel groups, pipelines, data-parallel ranks).

train.py builds it first, from the launch's environment and flags, before any Accelerator exists. `running` then
confirms it against what accelerate brought up. Everything that needs a degree or a world size reads it here.

What the rest of the code needs to know about an engine, it asks here, not by the engine's name: which terms it
shards, whether its processes are full replicas, in which dtype it holds parameters. A new engine answers these
questions once, in this class.

world_size = data_parallel_size x the product of the degrees; no two degrees are combined yet. The model-parallel
dimension is innermost: in a degree-2 launch, ranks r and r + 1 form one group or pipeline, and rank r's
data-parallel rank is r // 2.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from accelerate import Accelerator

from common.engine_names import DDP, DEEPSPEED, ENGINE_NAMES, FAMILY_NAMES, FSDP
from common.errors import UserError
from common.parallelism import Parallelism
from model.tensor_parallel import split_problem
from training.distributed.engines import launch_engine, running_engine
from training.distributed.machine import Machine, degree_here
from training.distributed.processes import process_state
from training.distributed.support import refusal


@dataclass(frozen=True)
class Layout:
    """`world_size` processes under `parallelism`: its engine holds the model, its degrees split it."""

    world_size: int = 1
    parallelism: Parallelism = Parallelism()

    @property
    def data_parallel_size(self) -> int:
        """The ranks that read different batches, over which FSDP2 shards: one per model-parallel group."""
        return self.world_size // self.parallelism.model_parallel

    def data_parallel_rank(self, rank: int) -> int:
        """The data-parallel rank (which batches it reads) of process `rank`."""
        return rank // self.parallelism.model_parallel

    # ---- what the engine does, asked here rather than of its name ----------------------------------------------

    @property
    def shards_parameters(self) -> bool:
        """Parameters are split over the data-parallel ranks and each unit is gathered for its forward and backward:
        FSDP2 and ZeRO-3."""
        return self.parallelism.kind == FSDP or self._zero_from(3)

    @property
    def shards_gradients(self) -> bool:
        """Each data-parallel rank keeps its share of the gradients only: FSDP2, ZeRO-2 and ZeRO-3."""
        return self.parallelism.kind == FSDP or self._zero_from(2)

    @property
    def shards_optimizer_state(self) -> bool:
        """Each data-parallel rank keeps its share of the optimizer state only: FSDP2 and ZeRO-1, 2 and 3."""
        return self.parallelism.kind == FSDP or self._zero_from(1)

    def _zero_from(self, stage: int) -> bool:
        return self.parallelism.kind == DEEPSPEED and self.parallelism.zero_stage >= stage

    @property
    def full_replicas(self) -> bool:
        """Every process holds the whole model and all-reduces gradients through DDP's buckets: DDP on several
        processes, without a pipeline (whose stages average stage by stage)."""
        return self.parallelism.kind == DDP and self.world_size > 1 and not self.parallelism.pipelined

    @property
    def reduces_in_buckets(self) -> bool:
        """Gradients are reduced through DeepSpeed's buckets (reduce_bucket_size): ZeRO-1 and 2 over several ranks.
        ZeRO-3 reduce-scatters unit by unit, as FSDP2 does."""
        p = self.parallelism
        return p.kind == DEEPSPEED and p.zero_stage in (1, 2) and self.data_parallel_size > 1

    @property
    def bf16_parameters(self) -> bool:
        """Under bf16, the forward computes with bf16 parameters, not autocast's copies of fp32 ones. FSDP2 gathers
        bf16 copies (param_dtype=bf16); DeepSpeed holds the module itself in bf16."""
        return self.parallelism.kind in (FSDP, DEEPSPEED)

    @property
    def fp32_master(self) -> bool:
        """Under bf16, parameters and gradients are stored in bf16 and the optimizer keeps an fp32 master copy:
        DeepSpeed. The other engines store fp32 parameters."""
        return self.parallelism.kind == DEEPSPEED

    @property
    def dtensor_matrices(self) -> bool:
        """The blocks' matrices are DTensors (FSDP2, with or without TP), so an optimizer that needs whole matrices
        gathers each one."""
        return self.parallelism.kind == FSDP

    @property
    def one_client_optimizer(self) -> bool:
        """The engine takes one client optimizer and hands it flat partitions, in which no matrix is whole:
        DeepSpeed's ZeRO. An optimizer that needs whole matrices runs there as DeepSpeed's own."""
        return self.parallelism.kind == DEEPSPEED

    def sharded(self) -> Layout:
        """This launch with its parameters sharded, as the memory planner advises: DDP becomes FSDP2, the others
        stay as they are."""
        return replace(self, parallelism=self.parallelism.on_engine(FSDP)) if self.parallelism.kind == DDP else self

    @property
    def sharding_name(self) -> str:
        """The engine that shards the parameters, as the support table's columns name it: "FSDP2", "ZeRO-3"."""
        return self.parallelism.engine.column

    def describe(self) -> str:
        """The launch in the memory plan's words: "one process", "DDP", "FSDP2", "DeepSpeed ZeRO-2", "FSDP2 over 4
        x tensor parallel 2", "2 pipeline(s) of 4 stages (1F1B)"."""
        p = self.parallelism
        if p.pipelined:
            return f"{self.data_parallel_size} pipeline(s) of {p.pipeline_parallel} stages (1F1B)"
        if p.split:
            return f"{p.engine.name} over {self.data_parallel_size}{p.degree_words}"
        return p.name if self.world_size > 1 or p.kind != DDP else "one process"

    @classmethod
    def of_launch(cls, flags: object, n_head: int | None = None, n_embd: int | None = None,
                  world_size: int | None = None, n_layer: int | None = None) -> Layout:
        """This launch's layout: the engine from accelerate's environment, the degrees from their flag group
        (`configs.schema.parallelism_group`). Call before anything is built.

        Refuses in one line a layout the launch cannot run, or a model it cannot split (when the shapes are given).
        `world_size` defaults to the process group's, which this joins; `--plan` passes WORLD_SIZE and joins none."""
        engine = launch_engine()
        world = process_state().num_processes if world_size is None else world_size
        layout = cls(world, Parallelism.of_flags(flags, engine.kind, engine.zero_stage)).check(Machine.this())
        if n_head is not None and n_embd is not None:
            layout.check_model(n_head, n_embd, n_layer)
        return layout

    def check(self, machine: Machine | None = None) -> Layout:
        """This layout, or a one-line UserError when train.py does not run it. The planner's `Launch` refuses the
        same launches in the same words. `machine`, where known, lets the line say that a degree needs a GPU."""
        p, world_size = self.parallelism, self.world_size
        if p.kind not in ENGINE_NAMES:
            raise UserError(f"engine {p.kind!r} is not one train.py runs; launch DDP, FSDP2 or DeepSpeed")
        if p.zero_stage not in (0, 1, 2, 3) or (p.zero_stage and p.kind != DEEPSPEED):
            raise UserError(f"ZeRO stage {p.zero_stage} under {FAMILY_NAMES[p.kind]} is not an engine train.py runs; "
                            "launch DDP, FSDP2 or DeepSpeed ZeRO-1, 2 or 3, one engine at a time")
        for degree, n in p.split:
            if n < 1:
                raise UserError(f"{degree.flag} must be positive, got {n}; pass a value of at least 1")
        # Each degree runs on its own engine, and alone: its row of the support table, read at the column of the
        # launch without it, gives the refusal. A degree on another engine than the launch's is named first.
        for degree, n in sorted(p.split, key=lambda split: split[0].engine == p.kind):
            asked = f"{degree.flag} {n}"
            if degree.engine != p.kind and machine is not None and (line := degree_here(asked, degree, machine)):
                raise UserError(line)
            if line := refusal(degree.flag, p.without(degree), asked=asked):
                raise UserError(line)
            if world_size % n:
                raise UserError(f"{asked} needs a multiple of {n} processes, this launch has {world_size}; launch "
                                f"{max(n, world_size // n * n)} processes (--num_processes), or pass a "
                                f"{degree.flag} that divides {world_size}")
        return self

    def check_model(self, n_head: int, n_embd: int, n_layer: int | None = None) -> None:
        """Refuse in one line a model whose heads or MLP width the TP degree does not divide, or one with fewer
        blocks than pipeline stages."""
        stages, degree = self.parallelism.pipeline_parallel, self.parallelism.tensor_parallel
        if n_layer is not None and stages > n_layer:
            raise UserError(f"--pipeline_parallel {stages} needs at least one block per stage, the model has "
                            f"{n_layer}; pass at most {n_layer}")
        if degree > 1 and (problem := split_problem(n_head, n_embd, degree)) is not None:
            divisors = [d for d in range(1, n_head + 1) if split_problem(n_head, n_embd, d) is None]
            raise UserError(f"--tensor_parallel {degree} cannot split this model: {problem}; pass one of "
                            f"{', '.join(map(str, divisors))}")

    def running(self, accelerator: Accelerator) -> Layout:
        """The layout as accelerate runs it, with the ZeRO stage read from its plugin. `check_engine` already checked
        the kind."""
        running = running_engine(accelerator)
        return replace(self, parallelism=self.parallelism.on_engine(running.kind, running.zero_stage))
