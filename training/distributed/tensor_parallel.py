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
lacks, and it refuses a CPU launch (docs/engines.md, "What the engines do on a CPU").
"""
from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator

from model.tensor_parallel import parallelize
from training.distributed.layout import Layout

DP, TP = "dp", "tp"  # the mesh's dimensions


def split(model: torch.nn.Module, layout: Layout, accelerator: Accelerator) -> torch.nn.Module:
    """Split `model` across each tensor-parallel group of `layout` and shard it with FSDP2 across the groups, as
    accelerate would (one FSDP2 unit per block, the root holding the rest, the plugin's mixed precision and
    resharding); a no-op without tensor parallelism. Call before the optimizers are built: they then hold the
    DTensors."""
    if layout.tensor_parallel == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(accelerator.device.type, (layout.data_parallel_size, layout.tensor_parallel),
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


def evaluation_ranks(layout: Layout, accelerator: Accelerator) -> Any:
    """What the evaluations take as their accelerator: this one, or under tensor or pipeline parallelism the same one
    seen as its data-parallel ranks (`DataParallelRanks`)."""
    return DataParallelRanks(accelerator, layout) if layout.model_parallel > 1 else accelerator


class DataParallelRanks:
    """An Accelerator as the evaluations see it under tensor or pipeline parallelism: `process_index` and
    `num_processes` count data-parallel ranks (a group shares its work: its ranks run the same forwards on the same
    rows), and `reduce`/`gather` combine the data-parallel ranks' results only (each group's ranks hold the same ones).
    Everything else is the Accelerator's."""

    def __init__(self, accelerator: Accelerator, layout: Layout) -> None:
        from torch.distributed import new_subgroups_by_enumeration

        self._accelerator = accelerator
        self.process_index = layout.data_parallel_rank(accelerator.process_index)
        self.num_processes = layout.data_parallel_size
        # One group per tensor-parallel index: the ranks that hold the same shard in different groups. Every rank
        # creates every group, in the same order (torch's rule for new groups).
        degree = layout.model_parallel
        ranks = [[d * degree + t for d in range(layout.data_parallel_size)] for t in range(degree)]
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
