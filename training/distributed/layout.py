"""The launch's parallel layout, one object: the number of processes, the engine that holds the model, and how the
processes share the work (tensor-parallel groups, pipelines, data-parallel ranks).

train.py builds it first, from the launch's environment and flags, before any Accelerator exists. `running` then
confirms it against what accelerate brought up. Everything that needs a degree or a world size reads it here.

What the rest of the code needs to know about an engine, it asks here, not by the engine's name: which terms it
shards, whether its processes are full replicas, in which dtype it holds parameters, whether it is pipelined. A
new engine answers these questions once, in this class.

world_size = data_parallel_size x tensor_parallel x pipeline_parallel; the last two are not combined yet. The
model-parallel dimension is innermost: in a degree-2 launch, ranks r and r + 1 form one group or pipeline, and
rank r's data-parallel rank is r // 2.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from accelerate import Accelerator

from common.engine_names import DDP, DEEPSPEED, ENGINE_NAMES, FAMILY_NAMES, FSDP, column, degrees, engine_name
from common.errors import UserError
from model.tensor_parallel import split_problem
from training.distributed.engines import Engine, launch_engine
from training.distributed.machine import Machine, tensor_parallel_here
from training.distributed.processes import process_state
from training.distributed.support import refusal


@dataclass(frozen=True)
class Layout:
    """`world_size` processes under engine `kind` (and ZeRO's `zero_stage`). `tensor_parallel` ranks split each
    block's matrices; `pipeline_parallel` stages hold whole blocks each. A degree of 1 means none."""

    world_size: int = 1
    kind: str = DDP
    zero_stage: int = 0
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    @property
    def data_parallel_size(self) -> int:
        """The ranks that read different batches, over which FSDP2 shards: one per model-parallel group."""
        return self.world_size // self.model_parallel

    def data_parallel_rank(self, rank: int) -> int:
        """The data-parallel rank (which batches it reads) of process `rank`."""
        return rank // self.model_parallel

    @property
    def engine(self) -> Engine:
        """The engine with its degrees: what the refusals judge and a checkpoint records."""
        return Engine(self.kind, self.zero_stage, self.tensor_parallel, self.pipeline_parallel)

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def model_parallel(self) -> int:
        """The consecutive ranks that hold one copy of the model between them (a TP group, a pipeline, or 1)."""
        return self.engine.model_parallel

    # ---- what the engine does, asked here rather than of its name ----------------------------------------------

    @property
    def shards_parameters(self) -> bool:
        """Parameters are split over the data-parallel ranks and each unit is gathered for its forward and backward:
        FSDP2 and ZeRO-3."""
        return self.kind == FSDP or self._zero_from(3)

    @property
    def shards_gradients(self) -> bool:
        """Each data-parallel rank keeps its share of the gradients only: FSDP2, ZeRO-2 and ZeRO-3."""
        return self.kind == FSDP or self._zero_from(2)

    @property
    def shards_optimizer_state(self) -> bool:
        """Each data-parallel rank keeps its share of the optimizer state only: FSDP2 and ZeRO-1, 2 and 3."""
        return self.kind == FSDP or self._zero_from(1)

    def _zero_from(self, stage: int) -> bool:
        return self.kind == DEEPSPEED and self.zero_stage >= stage

    @property
    def full_replicas(self) -> bool:
        """Every process holds the whole model and all-reduces gradients through DDP's buckets: DDP on several
        processes, without a pipeline (whose stages average stage by stage)."""
        return self.kind == DDP and self.world_size > 1 and not self.pipelined

    @property
    def reduces_in_buckets(self) -> bool:
        """Gradients are reduced through DeepSpeed's buckets (reduce_bucket_size): ZeRO-1 and 2 over several ranks.
        ZeRO-3 reduce-scatters unit by unit, as FSDP2 does."""
        return self.kind == DEEPSPEED and self.zero_stage in (1, 2) and self.data_parallel_size > 1

    @property
    def bf16_parameters(self) -> bool:
        """Under bf16, the forward computes with bf16 parameters, not autocast's copies of fp32 ones. FSDP2 gathers
        bf16 copies (param_dtype=bf16); DeepSpeed holds the module itself in bf16."""
        return self.kind in (FSDP, DEEPSPEED)

    @property
    def fp32_master(self) -> bool:
        """Under bf16, parameters and gradients are stored in bf16 and the optimizer keeps an fp32 master copy:
        DeepSpeed. The other engines store fp32 parameters."""
        return self.kind == DEEPSPEED

    @property
    def dtensor_matrices(self) -> bool:
        """The blocks' matrices are DTensors (FSDP2, with or without TP), so an optimizer that needs whole matrices
        gathers each one."""
        return self.kind == FSDP

    @property
    def one_client_optimizer(self) -> bool:
        """The engine takes one client optimizer and hands it flat partitions, in which no matrix is whole:
        DeepSpeed's ZeRO. An optimizer that needs whole matrices runs there as DeepSpeed's own."""
        return self.kind == DEEPSPEED

    @property
    def pipelined(self) -> bool:
        """The blocks run in stages, one per process of a pipeline (`training.distributed.pipeline`)."""
        return self.pipeline_parallel > 1

    def sharded(self) -> Layout:
        """This launch with its parameters sharded, as the memory planner advises: DDP becomes FSDP2, the others
        stay as they are."""
        return replace(self, kind=FSDP) if self.kind == DDP else self

    @property
    def sharding_name(self) -> str:
        """The engine that shards the parameters, as the support table's columns name it: "FSDP2", "ZeRO-3"."""
        return column(self.kind, self.zero_stage)

    def describe(self) -> str:
        """The launch in the memory plan's words: "one process", "DDP", "FSDP2", "DeepSpeed ZeRO-2", "FSDP2 over 4
        x tensor parallel 2", "2 pipeline(s) of 4 stages (1F1B)"."""
        if self.tensor_parallel > 1:
            return f"{engine_name(self.kind)} over {self.data_parallel_size}{degrees(self.tensor_parallel)}"
        if self.pipelined:
            return f"{self.data_parallel_size} pipeline(s) of {self.pipeline_parallel} stages (1F1B)"
        return self.name if self.world_size > 1 or self.kind != DDP else "one process"

    @classmethod
    def of_launch(cls, tensor_parallel: int, n_head: int | None = None, n_embd: int | None = None,
                  world_size: int | None = None, pipeline_parallel: int = 1, n_layer: int | None = None) -> Layout:
        """This launch's layout, from accelerate's environment and the degrees. Call before anything is built.

        Refuses in one line a layout the launch cannot run, or a model it cannot split (when the shapes are given).
        `world_size` defaults to the process group's, which this joins; `--plan` passes WORLD_SIZE and joins none."""
        engine = launch_engine()
        world = process_state().num_processes if world_size is None else world_size
        layout = cls.checked(world, engine.kind, engine.zero_stage, tensor_parallel, pipeline_parallel,
                             Machine.this())
        if n_head is not None and n_embd is not None:
            layout.check_model(n_head, n_embd, n_layer)
        return layout

    @classmethod
    def checked(cls, world_size: int, kind: str, zero_stage: int = 0, tensor_parallel: int = 1,
                pipeline_parallel: int = 1, machine: Machine | None = None) -> Layout:
        """The layout, or a one-line UserError when it is not one train.py runs (`check`)."""
        return cls(world_size, kind, zero_stage, tensor_parallel, pipeline_parallel).check(machine)

    def check(self, machine: Machine | None = None) -> Layout:
        """This layout, or a one-line UserError when train.py does not run it. The planner's `Launch` refuses the
        same launches in the same words. `machine`, where known, lets the line say that TP needs a GPU."""
        world_size, kind, zero_stage = self.world_size, self.kind, self.zero_stage
        tensor_parallel, pipeline_parallel = self.tensor_parallel, self.pipeline_parallel
        if kind not in ENGINE_NAMES:
            raise UserError(f"engine {kind!r} is not one train.py runs; launch DDP, FSDP2 or DeepSpeed")
        if zero_stage not in (0, 1, 2, 3) or (zero_stage and kind != DEEPSPEED):
            raise UserError(f"ZeRO stage {zero_stage} under {FAMILY_NAMES[kind]} is not an engine train.py runs; "
                            "launch DDP, FSDP2 or DeepSpeed ZeRO-1, 2 or 3, one engine at a time")
        for flag, degree in (("--tensor_parallel", tensor_parallel), ("--pipeline_parallel", pipeline_parallel)):
            if degree < 1:
                raise UserError(f"{flag} must be positive, got {degree}; pass a value of at least 1")
        asked = f"--pipeline_parallel {pipeline_parallel}"
        # Stages run on a DDP launch only, and not with tensor-parallel groups. Under DDP, --tensor_parallel is the
        # flag out of place, so its row of the support table gives that refusal.
        if pipeline_parallel > 1 and kind != DDP and (line := refusal("--pipeline_parallel", kind, zero_stage,
                                                                      tensor_parallel, asked=asked)):
            raise UserError(line)
        if tensor_parallel > 1:
            if kind != FSDP or pipeline_parallel > 1:
                if kind != FSDP and machine is not None and (line := tensor_parallel_here(tensor_parallel, machine)):
                    raise UserError(line)
                raise UserError(refusal("--tensor_parallel", kind, zero_stage, pipeline_parallel=pipeline_parallel,
                                        asked=f"--tensor_parallel {tensor_parallel}"))
            if world_size % tensor_parallel:
                raise UserError(f"--tensor_parallel {tensor_parallel} needs a multiple of {tensor_parallel} processes, "
                                f"this launch has {world_size}; launch "
                                f"{max(tensor_parallel, world_size // tensor_parallel * tensor_parallel)} processes "
                                f"(--num_processes), or pass a --tensor_parallel that divides {world_size}")
        if pipeline_parallel > 1 and world_size % pipeline_parallel:
            raise UserError(f"{asked} needs a multiple of {pipeline_parallel} processes (one per stage), this launch "
                            f"has {world_size}; launch "
                            f"{max(pipeline_parallel, world_size // pipeline_parallel * pipeline_parallel)} processes "
                            f"(--num_processes), or pass a --pipeline_parallel that divides {world_size}")
        return self

    def check_model(self, n_head: int, n_embd: int, n_layer: int | None = None) -> None:
        """Refuse in one line a model whose heads or MLP width the TP degree does not divide, or one with fewer
        blocks than pipeline stages."""
        if n_layer is not None and self.pipeline_parallel > n_layer:
            raise UserError(f"--pipeline_parallel {self.pipeline_parallel} needs at least one block per stage, the "
                            f"model has {n_layer}; pass at most {n_layer}")
        degree = self.tensor_parallel
        if degree > 1 and (problem := split_problem(n_head, n_embd, degree)) is not None:
            divisors = [d for d in range(1, n_head + 1) if split_problem(n_head, n_embd, d) is None]
            raise UserError(f"--tensor_parallel {degree} cannot split this model: {problem}; pass one of "
                            f"{', '.join(map(str, divisors))}")

    def running(self, accelerator: Accelerator) -> Layout:
        """The layout as accelerate runs it, with the ZeRO stage read from its plugin. `check_engine` already checked
        the kind."""
        running = Engine.of(accelerator)
        return replace(self, kind=running.kind, zero_stage=running.zero_stage)
