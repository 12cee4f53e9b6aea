"""Muon's torch optimizer: torch.optim.Muon with a faster Newton-Schulz (`Muon`).

`training.optimizers.muon` declares Muon to the run (flags, build, support-table cells). It imports this module only
to build or describe the optimizer, so train.py's command line reads the flags without torch.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor


def newton_schulz_dtype(device_type: str) -> torch.dtype:
    """The dtype Muon orthogonalises in on `device_type`.

    bfloat16 on accelerators (torch's choice: tensor cores multiply bf16 fastest) and on CPUs with bf16 matrix
    instructions (AVX-512-BF16, AMX). float32 on other CPUs: they emulate bf16 matmuls, 14x slower than fp32
    (docs/benchmarks.md, "The embedded default run"). The hardware alone decides, so a resume on the same machine
    computes the same bits."""
    if device_type != "cpu":
        return torch.bfloat16
    capabilities = torch.cpu.get_capabilities()
    native_bf16 = capabilities.get("avx512_bf16", False) or capabilities.get("amx_bf16", False)
    return torch.bfloat16 if native_bf16 else torch.float32


def orthogonalise(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration in `dtype`. In bfloat16 it is bit for bit torch's own: the
    same operations in the same order."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:  # iterate on the wide orientation: the Gram matrix x x^T is the smaller square
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


# torch 2.13 renamed all_gather_into_tensor (the old name warns each call); the GPU image's 2.11 has only the old one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def newton_schulz_stacked(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                          dtype: torch.dtype) -> torch.Tensor:
    """`orthogonalise` on a stack of K matrices of one wide shape, (K, m, n) with m <= n, returned in `dtype`.

    Each matrix goes through the same operations as in `orthogonalise`, batched. The two agree up to the order in which
    a kernel accumulates a product (tests/test_muon.py holds the bound). It takes only shapes and constants, never the
    learning rate, so it compiles once per shape."""
    a, b, c = coefficients
    x = x.to(dtype)
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= 1, each
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


class Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz in `ns_dtype`: stacked, split, and on sharded matrices.

    The constructor, param groups and state are torch's (one `momentum_buffer` per matrix), so checkpoints are
    interchangeable. `step` is torch's update; only the Newton-Schulz runs differently:

    - Stacked: one batched iteration per shape (`newton_schulz_stacked`), not ~15 small kernels per matrix. It is
      compiled with `compile_backend` when the run compiles.
    - Split (`split_group`): where a group's ranks hold the same averaged gradients of the same whole matrices (DDP,
      a pipeline stage's replicas), each orthogonalises its share of each stack, padded with zero matrices to one
      size. One all-gather per shape brings the rest. Momentum stays whole on every rank, so the state is one
      process's.
    - Sharded: a DTensor (FSDP2, tensor parallelism) is gathered whole, one at a time, and each rank keeps its
      piece. Stacking a whole shape would undo FSDP2's memory savings.

    `stacked = False` is torch's loop, the reference for the tests and `benchmarks/bench_muon_sharded.py`. The dtype,
    split and backend are attributes, not param-group fields, so they come from the run that steps, also after a
    resume. Only torch's default LR adjustment ("original") is offered."""

    stacked: bool = True  # a class attribute, so a benchmark may turn it off

    def __init__(self, params, *, ns_dtype: torch.dtype, **kwargs) -> None:
        if kwargs.get("adjust_lr_fn") not in (None, "original"):
            raise ValueError(f"adjust_lr_fn {kwargs['adjust_lr_fn']!r} is not implemented here; use None")
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        self.split_group: dist.ProcessGroup | None = None  # the ranks that share the orthogonalisations (`place`)
        self.compile_backend: str | Callable | None = None  # torch.compile's backend for the stacked iteration
        self._compiled: tuple[object, Callable] | None = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if self.stacked and not any(isinstance(p, DTensor) for p in params):
                self._stacked_step(group, params)
            else:
                self._per_matrix_step(group, params)
        return loss

    def _momentum_buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def _per_matrix_step(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
        for p in params:
            buf = self._momentum_buffer(p)
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            args = group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype
            if isinstance(update, DTensor):  # gathered whole; each rank keeps its own piece of the result
                whole = orthogonalise(update.full_tensor(), *args)
                update = distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
            else:
                update = orthogonalise(update, *args)
            p.mul_(1 - lr * weight_decay)
            p.add_(update, alpha=-lr * math.sqrt(max(1, p.size(0) / p.size(1))))

    def _stacked_step(self, group: dict, params: list[torch.Tensor]) -> None:
        if not params:
            return
        lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
        grads = [p.grad for p in params]
        buffers = [self._momentum_buffer(p) for p in params]
        torch._foreach_lerp_(buffers, grads, 1 - momentum)  # every matrix's momentum, on every rank
        shapes: dict[tuple, list[int]] = {}  # one stack per shape (and dtype, device), in the params' order
        for i, g in enumerate(grads):
            shapes.setdefault((tuple(g.shape), g.dtype, g.device), []).append(i)
        for indices in shapes.values():  # each shape's updates applied before the next shape's are computed
            stack = self._orthogonalised([grads[i] for i in indices], [buffers[i] for i in indices], momentum,
                                         group["nesterov"], (group["ns_coefficients"], group["ns_steps"],
                                                             group["eps"], self.ns_dtype))
            weights = [params[i] for i in indices]
            rows, cols = weights[0].shape
            if weight_decay:  # x 1.0 would be a pass over every weight for nothing
                torch._foreach_mul_(weights, 1 - lr * weight_decay)
            # One foreach add per shape, not one add per matrix. CUDA fuses a foreach only where its lists share a
            # dtype and strides, so the updates are first made the weights' dtype and layout (one copy per shape).
            updates = (stack.mT if rows > cols else stack).to(weights[0].dtype, memory_format=torch.contiguous_format)
            torch._foreach_add_(weights, updates.unbind(0), alpha=-lr * math.sqrt(max(1, rows / cols)))

    def _orthogonalised(self, grads: list[torch.Tensor], buffers: list[torch.Tensor], momentum: float,
                        nesterov: bool, args: tuple) -> torch.Tensor:
        """The orthogonalised updates of one shape's matrices: a (K, m, n) stack in their wide orientation (m <= n),
        in the Newton-Schulz dtype. With `split_group` this rank computes its share and gathers the rest."""
        group = self.split_group
        ranks = dist.get_world_size(group) if group is not None else 1
        share = -(-len(grads) // ranks)  # ceil: every rank's share has one size
        tall = grads[0].size(0) > grads[0].size(1)
        fill = ranks * share - len(grads)  # the last shares' padding: zero matrices (orthogonalised to zero)
        padding = [torch.zeros_like(grads[0].mT if tall else grads[0])] * fill if fill else []
        start = dist.get_rank(group) * share if ranks > 1 else 0

        def mine(tensors: list[torch.Tensor]) -> list[torch.Tensor]:  # this rank's share, on the wide orientation
            return ([t.mT if tall else t for t in tensors] + padding)[start:start + share]

        stack = torch.stack(mine(buffers))
        if nesterov:  # torch's grad.lerp(buf, momentum), for the matrices this rank orthogonalises
            stack = torch.stack(mine(grads)).lerp_(stack, momentum)
        out = self._newton_schulz()(stack, *args)
        del stack  # the fp32 share, freed before the gather
        if ranks == 1:
            return out
        gathered = out.new_empty((ranks * share, *out.shape[1:]))
        _all_gather(gathered, out, group=group)
        return gathered[:len(grads)]

    def _newton_schulz(self) -> Callable:
        """`newton_schulz_stacked`, compiled with `compile_backend` where one is set (each shape compiles once)."""
        if self.compile_backend is None:
            return newton_schulz_stacked
        if self._compiled is None or self._compiled[0] != self.compile_backend:
            self._compiled = (self.compile_backend, torch.compile(newton_schulz_stacked, backend=self.compile_backend,
                                                                  dynamic=False, fullgraph=True))
        return self._compiled[1]
