"""`--tensor_parallel N`: groups of N processes split each block's matrices (`model.tensor_parallel`'s plan), and
FSDP2 shards across the groups.

The layout is a 2-D device mesh ("dp", "tp"), tp innermost. Every rank of a group computes the same activations.
So a group reads one stream of batches, counted in data-parallel ranks, and its ranks must run every forward
together; the evaluations split their work over data-parallel ranks (`DataParallelRanks`).

Tensor parallelism rides on accelerate's FSDP2 plugin. The model is split, then `fully_shard`-ed over "dp" here;
`accelerator.prepare` takes an FSDP2 model as it is. FSDP2 then does what it does for any run: sharded checkpoints,
whole weights gathered for `final/`, the global gradient norm. accelerate's own route (`ParallelismConfig(tp_size=N)`)
does not run with this stack: it imports `ReplicateParallel`, which transformers 5 lacks, and it refuses a CPU
launch (docs/engines.md, "What the engines do on a CPU").
"""
from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator

from model.tensor_parallel import parallelize
from training.distributed.layout import Layout

DP, TP = "dp", "tp"  # the mesh's dimensions


def split(model: torch.nn.Module, layout: Layout, accelerator: Accelerator) -> torch.nn.Module:
    """Split `model` within each tensor-parallel group and shard it with FSDP2 across the groups, as accelerate would
    (one unit per block, the root holding the rest). A no-op without TP. Call before the optimizers are built, so
    that they hold the DTensors."""
    degree = layout.parallelism.tensor_parallel
    if degree == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(accelerator.device.type, (layout.data_parallel_size, degree),
                            mesh_dim_names=(DP, TP))
    model = parallelize(model.to(accelerator.device), mesh[TP])
    plugin = accelerator.state.fsdp_plugin
    # accelerate resolves the wrap policy by class name in `prepare`. Resolve it now: fully_shard renames Block.
    plugin.set_auto_wrap_policy(model)
    kwargs = {"mesh": mesh[DP], "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy()}
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=plugin.reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)  # the embeddings, the tied output layer and ln_f
    return model


def evaluation_ranks(layout: Layout, accelerator: Accelerator) -> Any:
    """The accelerator the evaluations take: under TP or a pipeline, seen as its data-parallel ranks."""
    return DataParallelRanks(accelerator, layout) if layout.parallelism.model_parallel > 1 else accelerator


class DataParallelRanks:
    """An Accelerator as the evaluations see it under TP or a pipeline. `process_index` and `num_processes` count
    data-parallel ranks, since a group's ranks run the same forwards on the same rows. `reduce` and `gather` combine
    across data-parallel ranks only. Everything else is the Accelerator's."""

    def __init__(self, accelerator: Accelerator, layout: Layout) -> None:
        from torch.distributed import new_subgroups_by_enumeration

        self._accelerator = accelerator
        self.process_index = layout.data_parallel_rank(accelerator.process_index)
        self.num_processes = layout.data_parallel_size
        # One group per index within a group: the ranks holding the same shard. Every rank creates every group, in
        # the same order, as torch requires.
        degree = layout.parallelism.model_parallel
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
