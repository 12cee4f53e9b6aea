"""Muon on the blocks' 2-D weights (attention and MLP projections), AdamW on the rest.

Muon orthogonalises a matrix's update, which suits hidden layers only, and torch's Muon takes 2-D parameters only;
embeddings, the tied output layer, biases and LayerNorms stay with AdamW. `Muon` below is torch.optim.Muon whose
Newton-Schulz orthogonalisation runs in the dtype the device multiplies fast (`newton_schulz_dtype`), not always in
bfloat16 as torch's does: a CPU without bf16 matrix units multiplies bf16 matrices 10x slower than fp32 ones.

The matrices of one shape are orthogonalised together, one batched Newton-Schulz per shape (`newton_schulz_stacked`,
compiled where the run compiles), and where several ranks hold the same averaged gradients (DDP, a pipeline stage's
replicas: `training.distributed.prepare.step_placement`) each orthogonalises its share and one all-gather per shape
gives it the rest (`Muon`). Muon orthogonalises whole matrices: under FSDP2 and tensor parallelism each matrix is
gathered whole for it, one at a time.
Under DeepSpeed's ZeRO it is refused (`SPEC.refused_under`): ZeRO hands a client optimizer flat partitions, in which
no matrix is whole, and the Muon DeepSpeed ships for ZeRO (`MuonWithAuxAdam`, orthogonalising whole matrices while
it fills the gradient partitions) clips the orthogonalised update by the global norm of updates and gradients
together, not the raw gradient as torch's Muon after `clip_grad_norm_` does: measured by
`benchmarks/muon_under_zero.py` (docs/benchmarks.md), 18% of the weights' move apart from one process after 10 steps
at --grad_clip 1 under ZeRO-1, 2 and 3 alike, 6e-6 (float rounding) with clipping off. LoRA's low-rank factors are
not hidden matrices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from common.engine_names import DEEPSPEED, FSDP_COLUMN, TP_COLUMN, ZERO_COLUMNS, Refusal, engine_name
from common.errors import UserError
from common.resume_rules import RESTORED, SCHEDULE, flag
from training.optimizers.spec import BLOCK_MATRICES, OptimizerPlan, OptimizerSpec, StepPlacement


@dataclass
class MuonFlags:
    """Muon's own flags, beside AdamW's (`--lr`, `--weight_decay`, `--beta1/2`)."""

    _argument_group_name = "Muon (--optimizer muon)"

    muon_lr: float = flag(0.02, "Muon's peak learning rate; same warmup and decay as --lr", SCHEDULE)
    muon_momentum: float = flag(0.95, "Muon's momentum (Nesterov)", RESTORED)
    muon_weight_decay: float = flag(0.0, "Muon's decoupled weight decay (each step w -= lr x wd x w)", RESTORED)

    def __post_init__(self) -> None:
        if not 0 < self.muon_lr < math.inf:
            raise UserError(f"--muon_lr must be positive, got {self.muon_lr}; use e.g. 0.02")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise UserError(f"--muon_momentum must be in [0, 1), got {self.muon_momentum}; use e.g. 0.95")
        if not 0 <= self.muon_weight_decay < math.inf:
            raise UserError(f"--muon_weight_decay must be 0 or more, got {self.muon_weight_decay}; use e.g. 0 or 0.01")


# --muon_lr as shipped: measured from scratch (docs/benchmarks.md), said as such where a run fine-tunes with it
DEFAULT_MUON_LR = next(f.default for f in fields(MuonFlags) if f.name == "muon_lr")


def newton_schulz_dtype(device_type: str) -> torch.dtype:
    """The dtype Muon orthogonalises in on `device_type`: bfloat16 on accelerators (torch's choice: tensor cores
    multiply bf16 fastest), and on CPUs with bf16 matrix instructions (AVX-512-BF16, AMX); float32 on every other
    CPU, which has no bf16 units and emulates bf16 matmuls (a 512 x 512 one at 1.2 GFLOP/s against 16.8 in fp32 on
    a 2-core AVX2 EPYC). Decided from the hardware alone, so a resume on the same machine computes the same bits."""
    if device_type != "cpu":
        return torch.bfloat16
    capabilities = torch.cpu.get_capabilities()
    native_bf16 = capabilities.get("avx512_bf16", False) or capabilities.get("amx_bf16", False)
    return torch.bfloat16 if native_bf16 else torch.float32


def orthogonalise(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration in `dtype`: with bfloat16, bit for bit torch's own
    (the same operations in the same order); with float32, the same iteration without bf16's rounding."""
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


# torch 2.13 renames all_gather_into_tensor (a warning each call), the GPU image's 2.11 has only the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def newton_schulz_stacked(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                          dtype: torch.dtype) -> torch.Tensor:
    """`orthogonalise` on a stack of K matrices of one wide shape, (K, m, n) with m <= n, at once: each divided by its
    own Frobenius norm, then the same quintic iteration with batched products (bmm, baddbmm). Returns the stack in
    `dtype`. Every matrix goes through the operations `orthogonalise` applies to it alone, so the two agree to the
    order in which a kernel accumulates a product (tests/test_muon.py states the bound); what is compiled of it
    (`Muon.compile_backend`) takes only shapes and constants, never the learning rate, so it compiles once per shape."""
    a, b, c = coefficients
    x = x.to(dtype)
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= 1, each
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


class Muon(torch.optim.Muon):
    """torch.optim.Muon with its orthogonalisation in `ns_dtype` (`newton_schulz_dtype`), stacked by shape, split over
    the data-parallel ranks, and on sharded matrices. torch's constructor, validation, param groups and state (one
    `momentum_buffer` per matrix, checkpoints interchangeable with torch's); `step` is torch's update (momentum,
    Nesterov, weight decay, lr x sqrt(max(1, rows / cols))) with three changes in how the Newton-Schulz runs:

    - Stacked (`stacked`, the default): the matrices of one shape are orthogonalised together, one batched iteration
      (`newton_schulz_stacked`) per shape instead of ~15 small kernels per matrix; compiled
      (`torch.compile(dynamic=False, fullgraph=True)`) with `compile_backend` when the run compiles its model.
    - Split (`split_group`, set by `place` from the run's engine): where every rank of a process group holds the
      same averaged gradient of the same whole matrices (DDP; the replicas of a pipeline stage), each rank
      orthogonalises its share of each shape's stack (ranks in order, each a contiguous share, the last ones padded
      with zero matrices so that every share has one size) and one all-gather into a stacked tensor per shape gives
      every rank all of them: the work per rank falls as 1 / ranks. The momentum stays whole on every rank (an
      elementwise update, cheap), so the state and the checkpoints are those of one process.
    - A matrix that FSDP2 shards or tensor parallelism splits (a DTensor) is gathered whole for its
      orthogonalisation: its momentum stays sharded like the matrix (the update before it is elementwise), one
      all-gather per matrix and step, the same Newton-Schulz on every rank, each rank keeping its own rows or
      columns of the result (one matrix at a time, never stacked nor split: gathering a whole shape at once would
      undo the memory FSDP2 saves).

    `stacked = False` is the loop of torch's own step, one matrix at a time on every rank, kept as the reference
    the stacked path is tested and benchmarked against (`benchmarks/bench_muon_sharded.py`). The dtype, the split and
    the compile backend are attributes, not param-group fields, so they always come from the run that steps, also
    after a resume. Only torch's default LR adjustment (`adjust_lr_fn` "original") is offered."""

    stacked: bool = True  # False: one matrix at a time, as torch.optim.Muon (a class attribute: a sweep may set it)

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
            if isinstance(update, DTensor):  # sharded (FSDP2) or split (tensor parallelism): the whole matrix
                # gathered, orthogonalised on every rank alike, and each rank keeps its own piece of the result
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
            torch._foreach_mul_(weights, 1 - lr * weight_decay)
            for p, update in zip(weights, stack):
                p.add_(update.mT if rows > cols else update, alpha=-lr * math.sqrt(max(1, rows / cols)))

    def _orthogonalised(self, grads: list[torch.Tensor], buffers: list[torch.Tensor], momentum: float,
                        nesterov: bool, args: tuple) -> torch.Tensor:
        """The orthogonalised updates of matrices of one shape, as a (K, m, n) stack on their wide orientation (m <=
        n), in the Newton-Schulz dtype: computed here, or this rank's share of them here and the rest gathered from
        the other ranks of `split_group`."""
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


def build(params: list[torch.nn.Parameter], plan: OptimizerPlan, device_type: str) -> torch.optim.Optimizer:
    own = plan.flags
    return Muon(params, lr=own.muon_lr, momentum=own.muon_momentum, weight_decay=own.muon_weight_decay,
                ns_dtype=newton_schulz_dtype(device_type))


def place(optimizer: Muon, placement: StepPlacement) -> None:
    """The run's data-parallel group splits the orthogonalisations (`Muon.split_group`); its compile backend compiles
    the stacked iteration (`Muon.compile_backend`)."""
    optimizer.split_group = placement.group if placement.ranks > 1 else None
    optimizer.compile_backend = placement.compile_backend


def describe(plan: OptimizerPlan, device_type: str, matrices: list[torch.Tensor], placement: StepPlacement) -> str:
    """"lr 0.02, Newton-Schulz in bfloat16, stacked by shape (4 groups), compiled, split over 8 ranks": how the step
    orthogonalises (`place` and `Muon.step`). Sharded matrices (DTensors) are one at a time, as the header says
    (`training.optimizers.plan.describe_optimizers`)."""
    ns_dtype = str(newton_schulz_dtype(device_type)).removeprefix("torch.")
    about = f"lr {plan.flags.muon_lr:g}"
    if not plan.job.startswith("from scratch") and plan.flags.muon_lr == DEFAULT_MUON_LR:
        about += f", its from-scratch default: none is measured for {plan.job}; --muon_lr sets it"
    about += f", Newton-Schulz in {ns_dtype}"
    if not Muon.stacked or any(isinstance(m, DTensor) for m in matrices):
        return about
    about += f", stacked by shape ({len({tuple(m.shape) for m in matrices})} groups)"
    about += ", compiled" if placement.compile_backend else ""
    return about + (f", split over {placement.ranks} ranks" if placement.ranks > 1 else "")


# Where each matrix is sharded or split (`Muon.step`): one all-gather of it a step, Newton-Schulz on every rank.
_GATHERED = "each matrix all-gathered a step"
# Measured (benchmarks/muon_under_zero.py, docs/benchmarks.md; tests/test_muon.py holds DeepSpeed to it).
_ZERO_WHY = ("ZeRO hands this Muon flat partitions, where no matrix is whole, and DeepSpeed's own Muon clips the "
             "orthogonalised update, not the gradient: 18% apart from torch's Muon after 10 steps at --grad_clip 1")
SPEC = OptimizerSpec(
    name="muon", display="Muon", claims=BLOCK_MATRICES, state_bytes=4,  # one fp32 momentum buffer per matrix
    flags=MuonFlags, build=build, peak_lr=lambda plan: plan.flags.muon_lr, describe=describe, place=place,
    refused_under={ZERO_COLUMNS[s]: Refusal(_ZERO_WHY, f"use --optimizer adamw with {engine_name(DEEPSPEED, s)}, or "
                                                       "Muon with a DDP or FSDP2 launch config")
                   for s in (1, 2, 3)},
    costs_under={column: _GATHERED for column in (FSDP_COLUMN, TP_COLUMN)},
    lora_refusal="Muon orthogonalises whole hidden matrices, not rank-{rank} factors", whole_matrices=True,
)
