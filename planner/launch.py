"""What a training process does with the model, as the planner sees it: its batch, its share of the model (the
engine's sharding: `Shards`), its precision; its layout is the run's (`training.layout.Layout`), and a feature an
engine does not run is refused from `training.support`'s table, as the run refuses it.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import UserError
from model.loss import default_loss_chunk_rows
from training.engine_names import DDP, DEEPSPEED, FSDP, engine_name
from training.layout import Layout
from training.optimizers.registry import OPTIMIZERS as REGISTERED
from training.optimizers.spec import OptimizerSpec
from training.support import refusal

GiB = 2**30
GB = 10**9
DTYPES = ("bf16", "fp32")
OPTIMIZERS = tuple(REGISTERED)  # as a run resolves --optimizer (auto is resolved before a plan)
DEVICES = ("cuda", "cpu")



@dataclass(frozen=True)
class Shards:
    """Over how many processes the parameters, their gradients and the optimizer state are split (each process holds
    1/n of the term). One process and DDP: 1, 1, 1 (every rank holds everything); FSDP2: N, N, N. An engine that
    splits them otherwise (DeepSpeed's ZeRO-1 shards the optimizer state only, ZeRO-2 the gradients too, ZeRO-3 all
    three) is one more case of `Launch.shards`: every phase of the plan takes these terms from here."""

    parameters: int = 1
    gradients: int = 1
    optimizer_state: int = 1

    def note(self, n: int) -> str:
        return f", sharded over {n}" if n > 1 else ""



@dataclass(frozen=True)
class Launch:
    """What a training process does with the model: its batch, its share of the model, its precision."""

    micro_batch_size: int
    processes: int = 1
    fsdp: bool = False
    zero_stage: int = 0  # DeepSpeed ZeRO-1, 2 or 3; 0: not DeepSpeed
    activation_checkpointing: bool = False
    optimizer: str = "adamw"  # a registered optimizer's name ("adamw", "muon": training.optimizers)
    dtype: str = "bf16"  # "bf16": accelerate's autocast (fp32 master weights), "fp32": no autocast
    accumulation: int = 1  # micro-steps per optimizer step: above 1 the gradients live through the forward
    device: str = "cuda"  # "cpu" adds the process's own RSS (Python, torch) and AdamW's for-loop temporaries
    # The tokens of one optimizer step when the run fixes them (train.py --plan): the advice then names only the
    # micro-batches the run accepts, with the accumulation each gives (`resized`). None: any micro-batch.
    total_batch_size: int | None = None
    # --tensor_parallel: the blocks' matrices split over groups of this many processes, FSDP2 over the
    # processes / tensor_parallel groups (`training.tensor_parallel`); 1: none.
    tensor_parallel: int = 1
    # --pipeline_parallel: the blocks in this many stages, one per process of a pipeline (`training.pipeline`), the
    # processes / pipeline_parallel pipelines averaging their gradients; 1: none.
    pipeline_parallel: int = 1
    # --loss_chunk_rows: the training loss's path (`model.loss`): 0 the full logits, N rows per chunk, None the
    # device's default (`model.loss.default_loss_chunk_rows`: chunks on the CPU, the full logits on CUDA).
    loss_chunk_rows: int | None = None

    @property
    def layout(self) -> Layout:
        """The launch's layout as a run holds it (`training.layout`)."""
        return Layout(self.processes, self.kind, self.zero_stage, self.tensor_parallel, self.pipeline_parallel)

    @property
    def loss_rows(self) -> int:
        """The loss path this launch runs: 0 the full logits, else the rows per chunk."""
        return default_loss_chunk_rows(self.device) if self.loss_chunk_rows is None else self.loss_chunk_rows

    @property
    def bubble(self) -> float:
        """The share of a pipelined step its stages wait (1F1B): (stages - 1) / (micro-batches + stages - 1)."""
        n = self.pipeline_parallel
        return (n - 1) / (self.accumulation + n - 1)

    @property
    def data_parallel(self) -> int:
        """The processes that read different batches (and over which FSDP2 shards): all, or one per TP group."""
        return self.layout.data_parallel_size

    @property
    def shards(self) -> Shards:
        """Over how many processes each per-process term is split: the engine's say (see `Shards`)."""
        n = self.data_parallel
        if self.zero_stage:
            return Shards(parameters=n if self.zero_stage >= 3 else 1, gradients=n if self.zero_stage >= 2 else 1,
                          optimizer_state=n)
        return Shards(parameters=n, gradients=n, optimizer_state=n) if self.fsdp else Shards()

    @property
    def kind(self) -> str:
        """The engine, as `training.support` keys it."""
        return DEEPSPEED if self.zero_stage else FSDP if self.fsdp else DDP

    @property
    def engine(self) -> str:
        if self.tensor_parallel > 1:
            return f"{engine_name(FSDP)} over {self.data_parallel} x tensor parallel {self.tensor_parallel}"
        if self.pipeline_parallel > 1:
            return f"{self.data_parallel} pipeline(s) of {self.pipeline_parallel} stages (1F1B)"
        return engine_name(self.kind, self.zero_stage) if self.processes > 1 or self.kind != DDP else "one process"

    @property
    def optimizer_spec(self) -> OptimizerSpec:
        """What the optimizer declares (`training.optimizers`): the parameters it claims, its state per parameter."""
        return REGISTERED[self.optimizer]

    @property
    def optimizer_shards(self) -> bool:
        """Whether the optimizer runs under FSDP2 (the planner's first advice when a replica does not fit)."""
        return refusal(f"--optimizer {self.optimizer}", FSDP) is None

    @property
    def replicas(self) -> bool:
        """Every process a full replica that all-reduces whole gradients in DDP's buckets (DDP, several processes)."""
        return self.processes > 1 and not self.fsdp and not self.zero_stage and self.pipeline_parallel == 1

    @property
    def gathers_parameters(self) -> bool:
        """Parameters sharded and gathered per unit for each forward and backward (FSDP2, ZeRO-3)."""
        return self.fsdp or self.zero_stage >= 3

    @property
    def bf16_parameters(self) -> bool:
        """The module's parameters themselves in bf16 (FSDP2's mixed precision, DeepSpeed's bf16), rather than
        autocast's bf16 copies of fp32 parameters."""
        return self.dtype == "bf16" and (self.fsdp or self.zero_stage > 0)

    def __post_init__(self) -> None:
        if self.loss_chunk_rows is not None and self.loss_chunk_rows < 0:
            raise UserError(f"--loss_chunk_rows must be 0 (the full logits) or a number of rows per chunk, got "
                            f"{self.loss_chunk_rows}; pass 0 or e.g. 512, or leave it out for the device's default")
        for name in ("micro_batch_size", "processes", "accumulation"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be positive, got {getattr(self, name)}; pass a value of at least 1")
        if self.optimizer not in REGISTERED:
            raise UserError(f"optimizer {self.optimizer!r} is not one the planner knows; use one of "
                            f"{', '.join(REGISTERED)}")
        if self.dtype not in DTYPES:
            raise UserError(f"precision {self.dtype!r} is not one the planner knows; use bf16 or fp32")
        if self.device not in DEVICES:
            raise UserError(f"device {self.device!r} is not one the planner knows; use cuda or cpu")
        if self.zero_stage not in (0, 1, 2, 3) or (self.zero_stage and self.fsdp):
            raise UserError(f"ZeRO stage {self.zero_stage} {'with FSDP2 ' if self.fsdp else ''}is not a launch the "
                            "planner knows; plan ZeRO stage 1, 2 or 3, or FSDP2, one engine at a time")
        if self.tensor_parallel < 1 or self.processes % self.tensor_parallel or (
                self.tensor_parallel > 1 and not self.fsdp):
            raise UserError(f"tensor parallel {self.tensor_parallel} over {self.processes} process(es)"
                            f"{'' if self.fsdp else ' without FSDP2'} is not a launch train.py runs; plan a degree "
                            "that divides the processes, with FSDP2")
        if self.pipeline_parallel > 1:
            Layout.checked(self.processes, self.kind, self.zero_stage, self.tensor_parallel,
                                self.pipeline_parallel)  # the run's refusals, in its words
        if line := refusal(f"--optimizer {self.optimizer}", self.kind, self.zero_stage, self.tensor_parallel,
                           pipeline_parallel=self.pipeline_parallel):
            raise UserError(line)
