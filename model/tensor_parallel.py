"""Tensor parallelism for our GPT: each block's four projections split across a tensor-parallel group's ranks.

It is Megatron's layout, through torch's `parallelize_module`. Everything else is replicated.

Per block, on a group of `degree` ranks (C = n_embd, H = n_head, both divisible by `degree`):

    attn.c_attn   column-wise: each rank computes q, k and v of its H/degree heads   weight (3C/degree, C)
    attn.c_proj   row-wise: each rank's heads' share of the output, summed (1 all-reduce)  weight (C, C/degree)
    mlp.c_fc      column-wise: 1/degree of the 4C hidden units                          weight (4C/degree, C)
    mlp.c_proj    row-wise: their share of the output, summed (1 all-reduce)            weight (C, 4C/degree)

Replicated (whole on every rank, plain tensors): the token and position embeddings, the tied output layer, the
LayerNorms, and the row-wise layers' biases. Activations between the layers are replicated too. So the chunked
loss (`model.loss`) runs unchanged on every rank of the group. Each computes the same loss over the whole
vocabulary: the head is not split (`docs/engines.md` says why).

The fused `c_attn` holds q, k and v one after another: rows [q | k | v], each head-major. That is the Hugging Face
layout the checkpoints and exports keep. A plain column split would give the first rank all of q and part of k.
So the rows are first put in head-group order (`head_group_order`): [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], where q_r
is the r-th 1/degree of q. Each rank's contiguous share is then q, k and v of its own heads.
`CausalSelfAttention` reads them with `chunk(3)`. The order is the identity for degree 1. A tensor-parallel
model's `c_attn` is in that order, and so are its training checkpoints. `natural_order` puts a full state dict
back in the Hugging Face order.
`reordered` moves one from one launch's order into another's.
"""
from __future__ import annotations

import torch
from torch import nn

from common.parallelism import Parallelism

# The two linears each block splits by output features (column-wise) and the two by input features (row-wise).
COLUMN_WISE = ("attn.c_attn", "mlp.c_fc")
ROW_WISE = ("attn.c_proj", "mlp.c_proj")
QKV = "attn.c_attn"


def split_problem(n_head: int, n_embd: int, degree: int) -> str | None:
    """Why these sizes cannot be split over `degree` ranks (None when they can).

    Each rank takes whole heads and an equal share of the MLP's 4 x n_embd hidden units."""
    if degree < 1:
        return f"a tensor-parallel degree of {degree}"
    if n_head % degree:
        return f"n_head {n_head} is not divisible by {degree} (each rank computes whole heads)"
    if (4 * n_embd) % degree:
        return f"the MLP's width 4 x n_embd = {4 * n_embd} is not divisible by {degree}"
    return None


def head_group_order(n_embd: int, degree: int) -> torch.Tensor:
    """The rows of `c_attn` (3 x n_embd, [q | k | v]) in head-group order: for each rank, q, k then v of its heads.

    `weight[order]` is the tensor-parallel layout; the identity for degree 1."""
    share = n_embd // degree
    return torch.cat([torch.arange(part * n_embd + r * share, part * n_embd + (r + 1) * share)
                      for r in range(degree) for part in range(3)])


def natural_order(state_dict: dict[str, torch.Tensor], n_embd: int, degree: int) -> dict[str, torch.Tensor]:
    """A full state dict of a tensor-parallel GPT (keys as GPT's own), its `c_attn` in the Hugging Face order.

    Every `c_attn` weight and bias goes back to [q | k | v]. Other tensors stay as they are (the same objects)."""
    if degree == 1:
        return state_dict
    inverse = torch.argsort(head_group_order(n_embd, degree))
    return {name: tensor[inverse] if _is_qkv(name) else tensor for name, tensor in state_dict.items()}


def parallel_order(state_dict: dict[str, torch.Tensor], n_embd: int, degree: int) -> dict[str, torch.Tensor]:
    """`natural_order`'s inverse: a full state dict in the Hugging Face order, made what a TP model holds.

    Every `c_attn` weight and bias goes into the head-group order of `degree`. Other tensors stay as they are."""
    if degree == 1:
        return state_dict
    order = head_group_order(n_embd, degree)
    return {name: tensor[order] if _is_qkv(name) else tensor for name, tensor in state_dict.items()}


def reordered(state_dict: dict[str, torch.Tensor], n_embd: int, was: Parallelism,
              now: Parallelism) -> dict[str, torch.Tensor]:
    """A full state dict in launch `was`'s order, put in launch `now`'s. Only `c_attn`'s weight and bias move.
    `Parallelism()` (not split) holds the Hugging Face order. The same dict when the two orders agree."""
    if was.tensor_parallel == now.tensor_parallel:
        return state_dict
    return parallel_order(natural_order(state_dict, n_embd, was.tensor_parallel), n_embd, now.tensor_parallel)


def _is_qkv(name: str) -> bool:
    return name.endswith((f"{QKV}.weight", f"{QKV}.bias"))


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """Split `model`'s blocks over the 1-D device mesh `mesh` (its size is the degree), in place.

    `c_attn` is put in head-group order first. Then each projection becomes a DTensor, sharded as the module
    docstring says. Every rank must hold the same weights (same seed, or the same loaded ones). Returns the model."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    degree, n_embd = mesh.size(), model.config.n_embd
    if (problem := split_problem(model.config.n_head, n_embd, degree)) is not None:
        raise ValueError(f"cannot split this GPT over {degree} ranks: {problem}")
    order = head_group_order(n_embd, degree)
    plan = {**{name: ColwiseParallel() for name in COLUMN_WISE}, **{name: RowwiseParallel() for name in ROW_WISE}}
    for block in model.transformer.h:
        qkv = block.get_submodule(QKV)
        with torch.no_grad():
            for tensor in (qkv.weight, qkv.bias):
                if tensor is not None:
                    tensor.copy_(tensor[order])
        parallelize_module(block, mesh, plan)
    return model
