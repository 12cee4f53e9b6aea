"""What a training process does with the model, as the planner sees it: its batch, its precision, its layout.

The layout is the run's (`training.distributed.layout.Layout`). Its share of the model (`Shards`) is what the
layout's engine shards. A launch the run refuses is refused here in the run's words. The layout's checks and
`training.distributed.support`'s table decide.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.engine_names import FSDP
from common.errors import UserError
from common.parallelism import Parallelism
from model.loss import default_loss_chunk_rows
from training.distributed.layout import Layout
from training.distributed.support import conditions, refusal
from training.optimizers.registry import OPTIMIZERS as REGISTERED
from training.optimizers.spec import OptimizerSpec

GiB = 2**30
GB = 10**9
DTYPES = ("bf16", "fp32")
OPTIMIZERS = tuple(REGISTERED)  # as a run resolves --optimizer (auto is resolved before a plan)
DEVICES = ("cuda", "cpu")



@dataclass(frozen=True)
class Shards:
    """Over how many processes the parameters, their gradients and the optimizer state are split.

    Each process holds 1/n of a term. n is the data-parallel ranks for a term the engine shards, else 1:
        one process, DDP: 1, 1, 1
        FSDP2, ZeRO-3:    N, N, N
        ZeRO-1:           1, 1, N
        ZeRO-2:           1, N, N
    Every phase of the plan takes these terms from here."""

    parameters: int = 1
    gradients: int = 1
    optimizer_state: int = 1

    @classmethod
    def of(cls, layout: Layout) -> Shards:
        n = layout.data_parallel_size
        return cls(*(n if sharded else 1 for sharded in (layout.shards_parameters, layout.shards_gradients,
                                                          layout.shards_optimizer_state)))

    def note(self, n: int) -> str:
        return f", sharded over {n}" if n > 1 else ""



@dataclass(frozen=True)
class Launch:
    """What a training process does with the model: its batch, its layout, its precision.

    The layout holds the processes, the engine and the degrees: `Launch(4, Layout(8, Parallelism(FSDP,
    tensor_parallel=2)))`."""

    micro_batch_size: int
    layout: Layout = Layout()
    activation_checkpointing: bool = False
    optimizer: str = "adamw"  # a registered optimizer's name ("adamw", "muon": training.optimizers)
    dtype: str = "bf16"  # "bf16": accelerate's autocast (fp32 master weights), "fp32": no autocast
    accumulation: int = 1  # micro-steps per optimizer step: above 1 the gradients live through the forward
    device: str = "cuda"  # "cpu" adds the process's own RSS (Python, torch) and AdamW's for-loop temporaries
    # The tokens of one optimizer step when the run fixes them (train.py --plan). The advice then names only the
    # micro-batches the run accepts, each with its accumulation (`resized`). None: any micro-batch.
    total_batch_size: int | None = None
    # --loss_chunk_rows: the training loss's path (`model.loss`). 0: the full logits. N: rows per chunk.
    # None: the device's default (`default_loss_chunk_rows`: 512-row chunks on the CPU, 65,536 on CUDA, where each
    # is one Triton kernel; a CUDA torch without Triton runs the full logits, which this plan does not follow).
    loss_chunk_rows: int | None = None
    # --grad_clip: 0 lets Muon run under ZeRO (`training.distributed.support`: a refusal that hangs on it)
    grad_clip: float = 1.0

    @property
    def loss_rows(self) -> int:
        """The loss path this launch runs: 0 the full logits, else the rows per chunk."""
        return default_loss_chunk_rows(self.device) if self.loss_chunk_rows is None else self.loss_chunk_rows

    @property
    def bubble(self) -> float:
        """The share of a pipelined step its stages wait (1F1B): (stages - 1) / (micro-batches + stages - 1)."""
        n = self.layout.parallelism.pipeline_parallel
        return (n - 1) / (self.accumulation + n - 1)

    @property
    def shards(self) -> Shards:
        """Over how many processes each per-process term is split: the engine's say (see `Shards`)."""
        return Shards.of(self.layout)

    @property
    def optimizer_spec(self) -> OptimizerSpec:
        """What the optimizer declares (`training.optimizers`): the parameters it claims, its state per parameter."""
        return REGISTERED[self.optimizer]

    @property
    def optimizer_shards(self) -> bool:
        """Whether the optimizer runs under FSDP2 (the planner's first advice when a replica does not fit)."""
        return refusal(f"--optimizer {self.optimizer}", Parallelism(FSDP)) is None

    @property
    def bf16_parameters(self) -> bool:
        """The forward computes with bf16 parameters, not with autocast's bf16 copies of fp32 ones.

        That takes bf16 and an engine that holds them so (`Layout.bf16_parameters`)."""
        return self.dtype == "bf16" and self.layout.bf16_parameters

    @property
    def fp32_master(self) -> bool:
        """The module's parameters and gradients are bf16, beside an fp32 master copy.

        That takes bf16 and an engine that keeps one (`Layout.fp32_master`)."""
        return self.dtype == "bf16" and self.layout.fp32_master

    def __post_init__(self) -> None:
        if self.loss_chunk_rows is not None and self.loss_chunk_rows < 0:
            raise UserError(f"--loss_chunk_rows must be 0 (the full logits) or a number of rows per chunk, got "
                            f"{self.loss_chunk_rows}; pass 0 or e.g. 512, or leave it out for the device's default")
        for name, value in (("micro_batch_size", self.micro_batch_size), ("processes", self.layout.world_size),
                            ("accumulation", self.accumulation)):
            if value < 1:
                raise UserError(f"--{name} must be positive, got {value}; pass a value of at least 1")
        if self.optimizer not in REGISTERED:
            raise UserError(f"optimizer {self.optimizer!r} is not one the planner knows; use one of "
                            f"{', '.join(REGISTERED)}")
        if self.dtype not in DTYPES:
            raise UserError(f"precision {self.dtype!r} is not one the planner knows; use bf16 or fp32")
        if self.device not in DEVICES:
            raise UserError(f"device {self.device!r} is not one the planner knows; use cuda or cpu")
        self.layout.check()  # the run's refusals, in its words
        if line := refusal(f"--optimizer {self.optimizer}", self.layout.parallelism,
                           settings=conditions(self.grad_clip)):
            raise UserError(line)
