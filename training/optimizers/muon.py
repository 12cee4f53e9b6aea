"""Muon on the blocks' 2-D weights (attention and MLP projections), AdamW on the rest.

Muon orthogonalises a matrix's update, which suits hidden layers only, and torch's Muon takes 2-D parameters only;
embeddings, the tied output layer, biases and LayerNorms stay with AdamW. `Muon` below is torch.optim.Muon whose
Newton-Schulz orthogonalisation runs in the dtype the device multiplies fast (`newton_schulz_dtype`), not always in
bfloat16 as torch's does: a CPU without bf16 matrix units multiplies bf16 matrices 10x slower than fp32 ones.

Muon orthogonalises whole matrices: under FSDP2 and tensor parallelism each matrix is gathered whole for it (`Muon`).
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
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from common.engine_names import DEEPSPEED, FSDP_COLUMN, TP_COLUMN, ZERO_COLUMNS, Refusal, engine_name
from common.errors import UserError
from common.resume_rules import RESTORED, SCHEDULE, flag
from training.optimizers.spec import BLOCK_MATRICES, OptimizerPlan, OptimizerSpec


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


class Muon(torch.optim.Muon):
    """torch.optim.Muon with its orthogonalisation in `ns_dtype` (`newton_schulz_dtype`), and on sharded matrices.
    torch's constructor, validation, param groups and state (one `momentum_buffer` per matrix, checkpoints
    interchangeable with torch's); `step` is torch's update, in which the Newton-Schulz dtype is ours, and a matrix
    that FSDP2 shards or tensor parallelism splits (a DTensor) is gathered whole for its orthogonalisation: its
    momentum stays sharded like the matrix (the update before it is elementwise), one all-gather per matrix and step,
    the same Newton-Schulz on every rank, each rank keeping its own rows or columns of the result. The dtype is an
    attribute, not a param-group field, so it always comes from the machine that runs, also after a resume.
    Only torch's default LR adjustment (`adjust_lr_fn` "original": lr x sqrt(max(1, rows / cols))) is offered."""

    def __init__(self, params, *, ns_dtype: torch.dtype, **kwargs) -> None:
        if kwargs.get("adjust_lr_fn") not in (None, "original"):
            raise ValueError(f"adjust_lr_fn {kwargs['adjust_lr_fn']!r} is not implemented here; use None")
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
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
        return loss


def build(params: list[torch.nn.Parameter], plan: OptimizerPlan, device_type: str) -> torch.optim.Optimizer:
    own = plan.flags
    return Muon(params, lr=own.muon_lr, momentum=own.muon_momentum, weight_decay=own.muon_weight_decay,
                ns_dtype=newton_schulz_dtype(device_type))


def describe(plan: OptimizerPlan, device_type: str) -> str:
    ns_dtype = str(newton_schulz_dtype(device_type)).removeprefix("torch.")
    return f"lr {plan.flags.muon_lr:g}, Newton-Schulz in {ns_dtype}"


# Where each matrix is sharded or split (`Muon.step`): one all-gather of it a step, Newton-Schulz on every rank.
_GATHERED = "each matrix all-gathered a step"
# Measured (benchmarks/muon_under_zero.py, docs/benchmarks.md; tests/test_muon.py holds DeepSpeed to it).
_ZERO_WHY = ("ZeRO hands this Muon flat partitions, where no matrix is whole, and DeepSpeed's own Muon clips the "
             "orthogonalised update, not the gradient: 18% apart from torch's Muon after 10 steps at --grad_clip 1")
SPEC = OptimizerSpec(
    name="muon", display="Muon", claims=BLOCK_MATRICES, state_bytes=4,  # one fp32 momentum buffer per matrix
    flags=MuonFlags, build=build, peak_lr=lambda plan: plan.flags.muon_lr, describe=describe,
    refused_under={ZERO_COLUMNS[s]: Refusal(_ZERO_WHY, f"use --optimizer adamw with {engine_name(DEEPSPEED, s)}, or "
                                                       "Muon with a DDP or FSDP2 launch config")
                   for s in (1, 2, 3)},
    costs_under={column: _GATHERED for column in (FSDP_COLUMN, TP_COLUMN)},
    lora_refusal="Muon orthogonalises whole hidden matrices, not rank-{rank} factors", whole_matrices=True,
)
