"""One chunk of the loss walk on a GPU: the logits, one Triton kernel over them, and the two gradient matmuls.

`model.loss._walk` hands each training chunk here on CUDA when Triton is installed (torch's CUDA wheels bring it).
The kernel replaces the walk's six torch passes over fp32 logits (max, subtract, exp, sum, scale, scatter) with one
program per row over the logits in the matmul's own dtype (bf16 under autocast):

- pass 1 reads the row once: its max and its sum of exponentials, block by block (an online softmax);
- the row's loss is logsumexp minus the target's logit (0 on an ignored row);
- pass 2 reads the row again and writes, in its place, softmax minus one-hot: the gradient of the row's loss.

So a chunk's logits are written once by the matmul, read twice and written once by the kernel, then read by the two
gradient matmuls. The full-logits path reads them three times and writes them twice (inductor's forward reduction,
its backward), and keeps them alive until the backward (issue 59's H200 profile: 72 ms of a 978 ms step).

`loss_chunk` is a custom op: torch.compile sees one opaque call with known output shapes, so the in-place kernel
never meets functionalization, and a compiled step keeps one graph.

Invariants: for x (rows, C), weight (V, C), targets (rows,), the outputs equal, to the rounding of `dtype`,
`F.cross_entropy(x @ weight.T, targets, reduction="none")` over the first `n_valid` columns, and the gradients of
their sum with respect to x (rows, C) and to weight (V, C), both in `dtype`. Ignored targets (-100)
give a loss of 0 and no gradient; columns from `n_valid` on get no probability and no gradient.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from data.tokenizer import IGNORE

# Columns a program loads at once, and its warps: the fastest of 12 pairs on an H200 (benchmarks/bench_loss_kernel.py:
# 5.20 ms over 65,536 x 50,304 bf16 logits, 3.8 TB/s; 4,096 x 8, which the 2026-11-28 sweep ran, 5.49 ms).
BLOCK = 2048
NUM_WARPS = 4


@triton.jit
def _loss_and_grad_rows(logits_ptr, row_stride, targets_ptr, losses_ptr, n_valid, n_cols,
                        IGNORE_ID: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program: its loss to losses[row]; softmax - one_hot over its logits, in place."""
    row = tl.program_id(0).to(tl.int64)
    ptr = logits_ptr + row * row_stride
    target = tl.load(targets_ptr + row)
    valid = target != IGNORE_ID
    safe_target = tl.where(valid, target, 0)
    # Pass 1: running max m and sum d of exp(logit - m); each block rescales d to its new max.
    m = float("-inf")
    d = 0.0
    for start in range(0, n_valid, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(ptr + cols, mask=cols < n_valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)
    target_logit = tl.load(ptr + safe_target).to(tl.float32)  # read before pass 2 overwrites it
    tl.store(losses_ptr + row, tl.where(valid, lse - target_logit, 0.0))
    # Pass 2: the gradient, 0 on the padding columns and on an ignored row.
    keep = tl.where(valid, 1.0, 0.0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(cols == safe_target, 1.0, 0.0)) * keep
        grad = tl.where(cols < n_valid, grad, 0.0)
        tl.store(ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=cols < n_cols)


@torch.library.custom_op("gpt2_accelerate::loss_chunk", mutates_args=())
def loss_chunk(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, n_valid: int, dtype: torch.dtype,
               need_x: bool, need_w: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-row losses (fp32), d(sum)/dx and d(sum)/dweight (in `dtype`; each empty unless asked for) of one
    chunk, with the matmuls in `dtype` (the autocast dtype, or the parameters'). The caller casts the weight once for
    all its chunks, and sums the weight's gradients in fp32."""
    # The caller chose `dtype` from its autocast state; inside, nothing is cast behind our back.
    with torch.autocast(x.device.type, enabled=False):
        xc, w = x.to(dtype), weight.to(dtype)
        logits = xc @ w.t()
        losses = torch.empty(x.size(0), device=x.device, dtype=torch.float32)
        _loss_and_grad_rows[(x.size(0),)](logits, logits.stride(0), targets, losses, n_valid, logits.size(1),
                                          IGNORE_ID=IGNORE, BLOCK=BLOCK, num_warps=NUM_WARPS)
        grad_x = logits @ w if need_x else x.new_empty(0, dtype=dtype)
        grad_w = logits.t() @ xc if need_w else x.new_empty(0, dtype=dtype)
    return losses, grad_x, grad_w


@loss_chunk.register_fake
def _(x, weight, targets, n_valid, dtype, need_x, need_w):
    return (x.new_empty(x.size(0), dtype=torch.float32),
            x.new_empty((x.size(0), x.size(1)) if need_x else (0,), dtype=dtype),
            weight.new_empty(weight.shape if need_w else (0,), dtype=dtype))
