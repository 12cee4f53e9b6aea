"""`--tensor_parallel N`: the launch's processes in groups of N that split each block's matrices between them
(`model.tensor_parallel`'s plan), and FSDP2 across the groups (2-D: `world = data-parallel x N`).

The layout is a 2-D device mesh ("dp", "tp"), tp innermost: ranks r and r + 1 of a degree-2 launch are one
tensor-parallel group, and rank r's data-parallel rank is r // N. Every rank of a group computes the same
activations, so a group reads one stream of batches (the loaders, the batch geometry and the dropout seeds count
data-parallel ranks, not processes), and its ranks must run every forward together (the evaluations split their
work over data-parallel ranks: `DataParallelRanks`).

Tensor parallelism rides on accelerate's FSDP2 plugin (the launch's accelerate config must be FSDP2): the model is
split, then `fully_shard`-ed over the "dp" dimension here, before `accelerator.prepare`, which takes a model that
is already FSDP2 as it is. FSDP2 then does what it does for any run: sharded checkpoints (torch.distributed
.checkpoint, which saves the tensor-parallel DTensors as they are), the whole weights gathered for `final/`, the
global gradient norm over every DTensor. accelerate's own route (`ParallelismConfig(tp_size=N)`) does not run
with this stack: its FSDP2 + TP preparation imports `ReplicateParallel` from transformers, which transformers 5
lacks, and it refuses a CPU launch (docs/architecture.md, ../shared/notes/engines-on-cpu.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator

from common.errors import UserError
from configs import ModelConfig
from model.tensor_parallel import parallelize, split_problem
from training.engines import Engine, requested_engine
from training.processes import process_state
from training.support import FSDP, refusal

DP, TP = "dp", "tp"  # the mesh's dimensions


@dataclass(frozen=True)
class TensorParallel:
    """How a launch of `world_size` processes splits the model: groups of `degree` ranks (1: no tensor
    parallelism), `world_size // degree` of them, which are the data-parallel ranks."""

    degree: int
    world_size: int

    @property
    def enabled(self) -> bool:
        return self.degree > 1

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.degree

    def data_parallel_rank(self, rank: int) -> int:
        """The data-parallel rank (which batches it reads) of process `rank`."""
        return rank // self.degree

    def describe(self) -> str:
        return f"tensor parallel {self.degree} x data parallel {self.data_parallel_size}"

    @classmethod
    def of_launch(cls, degree: int, model: ModelConfig) -> TensorParallel:
        """`--tensor_parallel degree` on this launch, refused in one line when the launch cannot run it or (from
        scratch: the flags give the architecture) the model cannot be split; call before anything is built."""
        layout = cls.checked(degree, process_state().num_processes, requested_engine())
        if model.from_scratch:
            layout.check_model(model.n_head, model.n_embd)
        return layout

    @classmethod
    def checked(cls, degree: int, world_size: int, engine: str) -> TensorParallel:
        """`--tensor_parallel degree` on a launch of `world_size` processes of `engine` ("ddp", "fsdp" or
        "deepspeed": `training.engines.requested_engine`), or a one-line UserError."""
        layout = cls(degree, world_size)
        if not layout.enabled:
            return layout
        if engine != FSDP:
            raise UserError(refusal("--tensor_parallel", engine, asked=f"--tensor_parallel {degree}"))
        if world_size % degree:
            raise UserError(f"--tensor_parallel {degree} needs a multiple of {degree} processes, this launch has "
                            f"{world_size}; launch {max(degree, world_size // degree * degree)} processes "
                            f"(--num_processes), or pass a --tensor_parallel that divides {world_size}")
        return layout

    def check_model(self, n_head: int, n_embd: int) -> None:
        """A model whose heads or MLP width `degree` does not divide, refused in one line."""
        if self.enabled and (problem := split_problem(n_head, n_embd, self.degree)) is not None:
            divisors = [d for d in range(1, n_head + 1) if split_problem(n_head, n_embd, d) is None]
            raise UserError(f"--tensor_parallel {self.degree} cannot split this model: {problem}; pass one of "
                            f"{', '.join(map(str, divisors))}")

    def engine(self, accelerator: Accelerator) -> Engine:
        """The engine this process runs, with the tensor-parallel degree (which checkpoints record)."""
        return Engine.of(accelerator, self.degree)

    def split(self, model: torch.nn.Module, accelerator: Accelerator) -> torch.nn.Module:
        """Split `model` across each tensor-parallel group and shard it with FSDP2 across the groups, as accelerate
        would (one FSDP2 unit per block, the root holding the rest, the plugin's mixed precision and resharding);
        a no-op without tensor parallelism. Call before the optimizers are built: they then hold the DTensors."""
        if not self.enabled:
            return model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(accelerator.device.type, (self.data_parallel_size, self.degree),
                                mesh_dim_names=(DP, TP))
        model = parallelize(model.to(accelerator.device), mesh[TP])
        plugin = accelerator.state.fsdp_plugin
        # accelerate resolves the config's wrap policy (fsdp_transformer_layer_cls_to_wrap: Block) by class name in
        # `prepare`; resolved now, while the blocks have it (fully_shard renames their class FSDPBlock).
        plugin.set_auto_wrap_policy(model)
        kwargs = {"mesh": mesh[DP], "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy()}
        for block in model.transformer.h:
            fully_shard(block, reshard_after_forward=plugin.reshard_after_forward, **kwargs)
        fully_shard(model, **kwargs)  # the embeddings, the tied output layer and ln_f
        return model

    def for_evaluations(self, accelerator: Accelerator) -> Any:
        """What the evaluations take as their accelerator: this one, or under tensor parallelism the same one
        seen as its data-parallel ranks (`DataParallelRanks`)."""
        return DataParallelRanks(accelerator, self) if self.enabled else accelerator


class DataParallelRanks:
    """An Accelerator as the evaluations see it under tensor parallelism: `process_index` and `num_processes`
    count data-parallel ranks (a group shares its work: its ranks run the same forwards on the same rows), and
    `reduce`/`gather` combine the data-parallel ranks' results only (each group's ranks hold the same ones).
    Everything else is the Accelerator's."""

    def __init__(self, accelerator: Accelerator, layout: TensorParallel) -> None:
        from torch.distributed import new_subgroups_by_enumeration

        self._accelerator = accelerator
        self.process_index = layout.data_parallel_rank(accelerator.process_index)
        self.num_processes = layout.data_parallel_size
        # One group per tensor-parallel index: the ranks that hold the same shard in different groups. Every rank
        # creates every group, in the same order (torch's rule for new groups).
        ranks = [[d * layout.degree + t for d in range(layout.data_parallel_size)] for t in range(layout.degree)]
        self._group, _ = new_subgroups_by_enumeration(ranks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        import torch.distributed as dist

        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction {reduction!r}; use sum or mean")
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=self._group)
        return tensor / self.num_processes if reduction == "mean" else tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.num_processes)]
        dist.all_gather(parts, tensor.contiguous(), group=self._group)
        return torch.cat(parts)
