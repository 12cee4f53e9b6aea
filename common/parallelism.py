"""A launch's parallelism, one value: the engine that holds the model and the degrees that split it.

`Parallelism` is built once, from the launch's flags (`of_flags`) and its accelerate config (the engine). The rest
of the code asks it through properties: its name, its column of the support table, each degree, the ranks that
hold one copy of the model. Functions that spell, refuse, plan or move a launch take it whole.

A degree is a `Degree`: its flag, its words, the engine it runs on, its row and column of the support table, and
what a resume may do when it changes. `DEGREES` holds them; a new degree is a `Degree` and one `register(...)`.
The flags (`configs.schema.parallelism_group`), the support table (`training.distributed.support`), the layout's
checks and the planner read the registry. tests/test_degrees.py registers a toy to prove it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from common.engine_names import DDP, DEEPSPEED, ENGINE_COLUMNS, ENGINE_NAMES, FAMILY_NAMES, FSDP, ZERO_COLUMNS, Refusal
from common.errors import UserError
from common.resume_rules import ACCEPTED, CHECKED


@dataclass(frozen=True)
class Degree:
    """One way to split the model over a launch's processes, `--NAME N` (1: not split)."""

    name: str  # its flag and its key in a checkpoint's engine record: "tensor_parallel"
    words: str  # a launch's name ends " x WORDS N": "tensor parallel"
    short: str  # its column of the support table is "ENGINE x SHORT": "TP"
    groups: str  # what its N processes form, for the refusal of two degrees at once: "tensor-parallel groups"
    engine: str  # the engine it runs on (DDP, FSDP); under any other it is refused with `needs`
    needs: Refusal  # why it needs its engine, and what to do
    in_checkpoint: bool  # the checkpoint's files depend on it, so a resume under another value moves them
    help: str  # its flag's --help
    refuses: Mapping[str, Refusal] = field(default_factory=dict, hash=False)  # its column's cells: feature -> why

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    @property
    def column(self) -> str:
        return f"{ENGINE_NAMES[self.engine]} x {self.short}"

    @property
    def resume(self) -> str:
        """What a resume may do with its flag (`common.resume_rules`): checked by the checkpoint's engine record when
        the files depend on it (another value moves them), else accepted."""
        return CHECKED if self.in_checkpoint else ACCEPTED


DEGREES: dict[str, Degree] = {}


def register(degree: Degree) -> Degree:
    """Add a degree (its name must be new): its flag, its words, its row and column of the support table."""
    if degree.name in DEGREES:
        raise ValueError(f"a degree named {degree.name!r} is already registered")
    DEGREES[degree.name] = degree
    return degree


def unregister(name: str) -> None:
    """Take a degree out again (a test's toy)."""
    DEGREES.pop(name, None)


TENSOR = register(Degree(
    name="tensor_parallel", words="tensor parallel", short="TP", groups="tensor-parallel groups", engine=FSDP,
    needs=Refusal("it runs on accelerate's FSDP2 plugin, FSDP2 across the tensor-parallel groups",
                  "launch with accelerate_configs/fsdp_8gpu.yaml, or leave out --tensor_parallel"),
    in_checkpoint=True,  # each rank's c_attn holds its heads' q, k and v: the checkpoint's order
    help="split each block's matrices over groups of N processes (tensor parallelism, with FSDP2 across the "
         "groups: needs an FSDP2 accelerate config); N must divide n_head and the processes; 1 = none",
    refuses={"--lora_rank": Refusal("peft's adapters wrap the layers tensor parallelism splits",
                                    "drop --tensor_parallel (a DDP or single-process config)")}))
PIPELINE = register(Degree(
    name="pipeline_parallel", words="pipeline", short="PP", groups="pipeline stages", engine=DDP,
    needs=Refusal("its stages run on a DDP launch, the pipelines' gradients averaged stage by stage; sharding inside "
                  "a stage is not built yet", "launch it with a DDP config (accelerate_configs/8gpu.yaml, "
                  "cpu_2proc.yaml), or leave out --pipeline_parallel"),
    in_checkpoint=False,  # a pipeline saves a DDP run's files, whatever its degree
    help="put the blocks on N processes in turn (pipeline parallelism, 1F1B over the step's micro-batches, which "
         "must be at least N; a DDP accelerate config); N must divide the processes; 1 = none",
    refuses={"--lora_rank": Refusal("its checkpoints hold the adapters, which the pipeline's whole-model "
                                    "checkpoints do not gather",
                                    "drop --pipeline_parallel (the adapters train in a few MB: DDP is enough)")}))


@dataclass(frozen=True, init=False)
class Parallelism:
    """The engine `kind` ("ddp", "fsdp" or "deepspeed", with ZeRO's `zero_stage` 1-3; 0 while not known) and the
    size of each registered degree. `Parallelism(FSDP, tensor_parallel=2)`; a degree not given is 1.

    `sizes` keeps the degrees above 1 only, in `DEGREES`' order, so two launches that split alike are equal."""

    kind: str
    zero_stage: int
    sizes: tuple[tuple[str, int], ...]

    def __init__(self, kind: str = DDP, zero_stage: int = 0, **sizes: int) -> None:
        if unknown := set(sizes) - set(DEGREES):
            raise TypeError(f"no degree named {', '.join(sorted(unknown))}; registered: {', '.join(DEGREES)}")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "zero_stage", zero_stage)
        object.__setattr__(self, "sizes", tuple((name, sizes[name]) for name in DEGREES if sizes.get(name, 1) != 1))

    @classmethod
    def of_flags(cls, flags: object, kind: str = DDP, zero_stage: int = 0) -> Parallelism:
        """The launch's parallelism from its flag group (one field per degree) and its engine."""
        return cls(kind, zero_stage, **{name: getattr(flags, name) for name in DEGREES})

    @classmethod
    def of_record(cls, record: dict[str, object]) -> Parallelism:
        """The parallelism a checkpoint's run_state.json records ("engine"). Older ones lack the degrees: 1."""
        unknown = [f"{key} {value}" for key, value in record.items()
                   if key not in ("kind", "zero_stage", *DEGREES) and value not in (None, 1)]
        if unknown:
            raise UserError(f"the checkpoint was saved with {', '.join(unknown)}, which this version does not know; "
                            "resume it with the version that saved it")
        return cls(str(record.get("kind")), int(record.get("zero_stage") or 0),
                   **{name: int(record.get(name) or 1) for name in DEGREES})

    def as_record(self) -> dict[str, object]:
        """How a checkpoint records it (run_state.json's "engine"): every degree, 1 included."""
        return {"kind": self.kind, "zero_stage": self.zero_stage, **{name: self.size(name) for name in DEGREES}}

    # ---- the degrees ----------------------------------------------------------------------------------------------

    def size(self, degree: Degree | str) -> int:
        """How many processes `degree` splits the model over (1: not split)."""
        return dict(self.sizes).get(degree if isinstance(degree, str) else degree.name, 1)

    @property
    def split(self) -> tuple[tuple[Degree, int], ...]:
        """The degrees above 1 with their sizes, in `DEGREES`' order."""
        return tuple((DEGREES[name], n) for name, n in self.sizes)

    @property
    def tensor_parallel(self) -> int:
        return self.size(TENSOR)

    @property
    def pipeline_parallel(self) -> int:
        return self.size(PIPELINE)

    @property
    def pipelined(self) -> bool:
        """The blocks run in stages, one per process of a pipeline (`training.distributed.pipeline`)."""
        return self.pipeline_parallel > 1

    @property
    def model_parallel(self) -> int:
        """The consecutive ranks that hold one copy of the model between them (a TP group, a pipeline, or 1)."""
        return math.prod(n for _, n in self.sizes)

    def with_sizes(self, **sizes: int) -> Parallelism:
        """The same engine with these degrees changed."""
        return Parallelism(self.kind, self.zero_stage, **{**dict(self.sizes), **sizes})

    def without(self, degree: Degree) -> Parallelism:
        return self.with_sizes(**{degree.name: 1})

    def on_engine(self, kind: str, zero_stage: int = 0) -> Parallelism:
        """The same degrees under another engine."""
        return Parallelism(kind, zero_stage, **dict(self.sizes))

    @property
    def engine(self) -> Parallelism:
        """The engine alone, without its degrees."""
        return Parallelism(self.kind, self.zero_stage)

    @property
    def checkpoint_layout(self) -> Parallelism:
        """What a checkpoint's files depend on: the engine and the degrees `in_checkpoint`. A resume whose layout
        differs moves the checkpoint (`training.checkpoints.moving`)."""
        return Parallelism(self.kind, self.zero_stage, **{d.name: n for d, n in self.split if d.in_checkpoint})

    # ---- its words: the one place a launch is spelled ------------------------------------------------------------

    @property
    def name(self) -> str:
        """"DDP", "FSDP2 x tensor parallel 2", "DeepSpeed ZeRO-2" ("DeepSpeed" while the stage is not known)."""
        known = self.zero_stage or self.kind != DEEPSPEED
        return (ENGINE_NAMES[self.kind].format(stage=self.zero_stage) if known else FAMILY_NAMES[self.kind]) + \
            self.degree_words

    @property
    def degree_words(self) -> str:
        """" x tensor parallel N", " x pipeline N": how every name of a launch (the engine's, the run header's, the
        plan's) ends."""
        return "".join(f" x {degree.words} {n}" for degree, n in self.split)

    @property
    def column(self) -> str:
        """Its column of the support table: its degree's (the last one, when a launch asks for two: those are
        refused), else its engine's. A DeepSpeed stage not yet known (0) reads ZeRO-1's: no refusal differs by
        stage."""
        if self.split:
            return self.split[-1][0].column
        return ZERO_COLUMNS[self.zero_stage or 1] if self.kind == DEEPSPEED else ENGINE_NAMES[self.kind]

    def header_words(self, distributed_type: str, stage: str | None = None) -> str:
        """How the run header names it after "distributed: ", e.g. "DEEPSPEED (ZeRO-3)", "FSDP x tensor parallel 2",
        "MULTI_GPU x pipeline 4 (1F1B; this stage: blocks 0-2 of 12)". `distributed_type` is accelerate's; `stage`
        names a pipeline stage's blocks. benchmarks/gpu_acceptance.py parses it."""
        zero = f" (ZeRO-{self.zero_stage})" if self.kind == DEEPSPEED else ""
        schedule = f" (1F1B; this stage: {stage})" if stage else ""
        return f"{distributed_type}{zero}{self.degree_words}{schedule}"


def columns() -> tuple[str, ...]:
    """The support table's columns: each engine a launch can run, then each registered degree's."""
    return (*ENGINE_COLUMNS, *(d.column for d in DEGREES.values()))
