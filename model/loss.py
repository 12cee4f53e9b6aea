"""Cross-entropy of the output layer, on one of two paths chosen by one integer, `loss_chunk_rows`.

- `N > 0`: `chunked_cross_entropy` walks the tokens in chunks of N rows. It never holds the full (tokens x vocab)
  logits. For each chunk it computes the logits, the loss, and at once the gradients they contribute to the hidden
  states and to the output weight. Then it drops the chunk. The backward only scales the two stored gradients.
  Nothing is recomputed. What stays alive from forward to backward is one (tokens x n_embd) and one weight-sized
  tensor. This is why the default CPU run fits and is fast. On CUDA with Triton a chunk is one kernel call
  (`model.loss_kernel`): the logits stay in the matmul's dtype, read twice and overwritten once by their gradient.
- `0`: `full_cross_entropy`, the full logits and one `F.cross_entropy`, as nanoGPT, torchtitan, nanochat and
  modded-nanogpt compute it. Under autocast the logits are bf16 and the softmax fp32. The upcast is explicit, so
  bf16 parameters without autocast get an fp32 softmax too. When the model is compiled this runs inside the
  compiled region, where inductor fuses the upcast, the softmax and their backward.

docs/internals.md ("The loss's two paths") gives each path's bytes and what was not done.
`default_loss_chunk_rows(device type)` is the path a device gets when the run does not choose one: the walk on a
CPU and on CUDA, where it was measured faster. `loss_chunk_rows_on(device type, rows)` is what a forward runs (on
CUDA without Triton, the full logits). `cross_entropy` takes either path (None: that default, for the hidden
states' device).

Without gradients (evaluation) the walk gives the loss alone, also per token (`reduction="none"`). So the
validation loss and HellaSwag's per-token scores never hold the full logits either. `model.gpt` evaluates on the
walk whatever the training path.

Invariants: on both paths the loss and both gradients equal `F.cross_entropy(F.linear(x, weight), targets)`, to
float rounding. That is over the first `n_valid` columns; the rest is the embedding's padding, given no probability.
Targets of -100 are ignored (a loss of 0 per ignored token with "none"). The rounding is ~1e-7 relative in fp32;
`tests/test_loss.py` states its bounds. Under autocast the matmuls run in the autocast dtype and the softmax in
fp32. The walk sums the weight gradient over chunks in the weight's dtype (fp32), one rounding per chunk.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import torch
from torch.nn import functional as F
from torch.utils._triton import has_triton

from data.tokenizer import IGNORE

# Token rows per chunk on a CPU: 512 x 50,304 fp32 logits are 103 MB. Measured on a 2-core CPU (GPT-2 head,
# 2,048 tokens), 512 rows cost the same CPU time as the plain loss. 256 cost about 10% more, 128 about 30%.
LOSS_CHUNK_ROWS = 512
# Token rows per chunk on CUDA: a GPT-2 preset's micro-batch (64 x 1,024) in one kernel call. On an H200 16,384
# rows (4 calls) gave 0.8% less than one call, at 4 GiB less peak memory (docs/benchmarks.md).
KERNEL_CHUNK_ROWS = 65536
# The device type whose chunks run `model.loss_kernel` (where Triton is installed); the planner counts its bytes.
KERNEL_DEVICE_TYPE = "cuda"


def default_loss_chunk_rows(device_type: str) -> int:
    """The loss path of a device type when the run does not choose one (`--loss_chunk_rows` left out), as planned.

    On the CPU: the walk in chunks of LOSS_CHUNK_ROWS rows. It was measured as fast as the full logits there, at
    half the memory (docs/benchmarks.md). On CUDA: the walk in chunks of KERNEL_CHUNK_ROWS, each one Triton kernel
    (`model.loss_kernel`): on an H200 at the GPT-2 presets' shape, 1.6% (Muon) and 1.9% (AdamW) more tokens/s
    than the full logits. A CUDA torch without Triton (Windows' wheels) runs the full logits instead
    (`loss_chunk_rows_on`). Other accelerators: 0, the full logits."""
    return {"cpu": LOSS_CHUNK_ROWS, KERNEL_DEVICE_TYPE: KERNEL_CHUNK_ROWS}.get(device_type, 0)


def loss_chunk_rows_on(device_type: str, chunk_rows: int | None) -> int:
    """The path a forward on a device of this type runs: `chunk_rows`, or else the device's default where it runs."""
    if chunk_rows is not None:
        return chunk_rows
    if device_type == KERNEL_DEVICE_TYPE and not fused_chunks(device_type):
        return 0
    return default_loss_chunk_rows(device_type)


def fused_chunks(device_type: str) -> bool:
    """Whether the walk's chunks run one Triton kernel each (`model.loss_kernel`): on CUDA with Triton.

    In a CUDA build torch.compile calls this while tracing and keeps the answer as a constant (below): `has_triton`
    and an import inside a traced forward are each a graph break (torch 2.11, H200: 8 breaks a step). The import
    registers the kernel's custom op, which the walk then calls through `torch.ops`."""
    if device_type != KERNEL_DEVICE_TYPE or not has_triton():
        return False
    import model.loss_kernel  # noqa: F401  (imports Triton: only where it runs)
    return True


if torch.backends.cuda.is_built():  # marking it imports torch._dynamo: ~1 s that a CPU-only process never pays
    fused_chunks = torch.compiler.assume_constant_result(fused_chunks)


def describe_loss_path(rows: int, device_type: str = "cpu") -> str:
    """A few words for the run's header: "loss: full logits", "loss: 512-row chunks", or on CUDA with Triton
    "loss: 65536-row chunks (Triton)"."""
    if rows == 0:
        return "loss: full logits"
    return f"loss: {rows}-row chunks" + (" (Triton)" if fused_chunks(device_type) else "")


def cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, n_valid: int,
                  reduction: str = "mean", chunk_rows: int | None = None) -> torch.Tensor:
    """Cross-entropy of `x @ weight.T` (columns from `n_valid` on excluded) against `targets`.

    `chunk_rows` names the path. 0: the full logits (`full_cross_entropy`). N > 0: the walk in chunks of N rows
    (`chunked_cross_entropy`). None: the default of the device `x` is on (`loss_chunk_rows_on`)."""
    rows = loss_chunk_rows_on(x.device.type, chunk_rows)
    if rows < 0:
        raise ValueError(f"loss_chunk_rows must be 0 (the full logits) or a number of rows per chunk, not {rows}")
    if rows == 0:
        return full_cross_entropy(x, weight, targets, n_valid, reduction)
    return chunked_cross_entropy(x, weight, targets, n_valid, reduction, rows)


def full_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, n_valid: int,
                       reduction: str = "mean") -> torch.Tensor:
    """The full (tokens x V) logits and one `F.cross_entropy` in fp32.

    Shapes and reductions are `chunked_cross_entropy`'s ("none" with gradients too). The matmul runs over all V
    rows: aligned sizes are what make it fast on tensor cores. A bias of -inf on the padding columns, fused into
    the matmul, gives them no probability. So no (tokens x V) tensor is written twice. Filling the slice in place
    instead makes autograd clone the whole logits gradient."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"full_cross_entropy supports reduction 'mean', 'sum' or 'none', not {reduction!r}")
    bias = None
    if n_valid < weight.size(0):
        bias = torch.zeros(weight.size(0), device=x.device, dtype=x.dtype)
        bias[n_valid:] = float("-inf")
    # In one expression: the bf16 logits are freed once upcast. So eager holds at most the fp32 copy and its
    # log-softmax (planner.memory counts them).
    loss = F.cross_entropy(F.linear(x.reshape(-1, x.size(-1)), weight, bias).float(), targets.reshape(-1),
                           ignore_index=IGNORE, reduction=reduction)
    return loss.view(targets.shape) if reduction == "none" else loss


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, n_valid: int,
                          reduction: str = "mean", chunk_rows: int | None = None) -> torch.Tensor:
    """Cross-entropy of `x @ weight.T` (columns from `n_valid` on excluded) against `targets`, walked in chunks.

    x: (..., C) hidden states; weight: (V, C); targets: (...) ids, -100 = ignore. `chunk_rows` rows per chunk
    (None: LOSS_CHUNK_ROWS). `reduction`:
      "mean" over the non-ignored targets (NaN when there is none, like F.cross_entropy);
      "sum";
      "none": the targets' shape, 0 at ignored ones. Only without gradients: its backward would need the logits."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"chunked_cross_entropy supports reduction 'mean', 'sum' or 'none', not {reduction!r}")
    rows = LOSS_CHUNK_ROWS if chunk_rows is None else chunk_rows
    if rows < 1:
        raise ValueError(f"chunked_cross_entropy needs chunks of at least 1 row, not {rows}")
    if reduction == "none":
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            raise ValueError("chunked_cross_entropy's reduction 'none' gives no gradients; use 'mean' or 'sum'")
        with torch.no_grad():
            walk = _walk(x.reshape(-1, x.size(-1)), weight, targets.reshape(-1), n_valid, rows, need_x=False,
                         need_w=False)
        return walk.losses.view(targets.shape)
    return _ChunkedCrossEntropy.apply(x.reshape(-1, x.size(-1)), weight, targets.reshape(-1), n_valid,
                                      reduction == "mean", rows)


# The walk's logits buffer on a CPU, kept from one call to the next: one per thread, the largest asked for.
_held = threading.local()


def _logits_buffer(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """A (rows, cols) fp32 buffer for the walk's logits.

    On a CPU it is this thread's held buffer, grown when too small, and it stays allocated between walks. A fresh
    one each walk cost more than its matmul: glibc maps a block this large (over 32 MB) anew each time, and the first
    write zero-fills every page (27 ms against 8 ms for the default run's 256 x 50,304 matmul, 2-core Xeon). CUDA's
    caching allocator already reuses memory; inside torch.compile the compiler owns the buffers."""
    if device.type != "cpu" or torch.compiler.is_compiling():
        return torch.empty(rows, cols, device=device, dtype=torch.float32)
    held = getattr(_held, "buffer", None)
    if held is None or held.numel() < rows * cols:
        held = _held.buffer = torch.empty(rows * cols, dtype=torch.float32)
    return held[:rows * cols].view(rows, cols)


class _Walk(NamedTuple):
    losses: torch.Tensor  # (tokens,) fp32, 0 at ignored targets
    grad_x: torch.Tensor | None  # d(sum of losses) / dx, when asked for
    grad_w: torch.Tensor | None  # d(sum of losses) / dweight, when asked for


def _walk(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, n_valid: int, rows: int, need_x: bool,
          need_w: bool) -> _Walk:
    """The chunk walk: x (N, C), weight (V, C), targets (N,), `rows` per chunk. No (N, V) tensor is ever held.

    Per chunk: its logits, its per-token losses, and when asked for, the gradients of the losses' sum."""
    # Under autocast, matmul's result is in the autocast dtype: addmm_ cannot add it into the fp32 weight
    # gradient in place. A separate product and add keeps that sum in fp32.
    autocast = torch.is_autocast_enabled(x.device.type)
    # bf16 parameters without autocast (DeepSpeed's bf16): the matmuls run in bf16, as under autocast. The logits
    # and the weight gradient's sum are fp32, cast to the weight's dtype at the end.
    low = None if autocast or x.dtype == torch.float32 else x.dtype
    grad_x = torch.empty_like(x) if need_x else None
    grad_w = torch.zeros_like(weight, dtype=torch.float32 if low else weight.dtype) if need_w else None
    losses = torch.empty(x.size(0), device=x.device, dtype=torch.float32)
    if fused_chunks(x.device.type):  # evaluation too: no fp32 (rows x V) buffer on a GPU
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        w = weight.to(dtype)  # once, not per chunk
        for start in range(0, x.size(0), rows):
            part = torch.ops.gpt2_accelerate.loss_chunk(x[start:start + rows], w, targets[start:start + rows],
                                                        n_valid, dtype, need_x, need_w)
            losses[start:start + rows] = part[0]
            if need_x:
                grad_x[start:start + rows] = part[1]
            if need_w:
                grad_w += part[2]
        return _Walk(losses, grad_x, None if grad_w is None else grad_w.to(weight.dtype))
    # One fp32 logits buffer for every chunk, and no other (rows x V) tensor (see `_logits_buffer`).
    buffer = _logits_buffer(min(x.size(0), rows), weight.size(0), x.device)
    for start in range(0, x.size(0), rows):
        xc, tc = x[start:start + rows], targets[start:start + rows]
        logits = buffer[:xc.size(0)]  # (rows, V) in fp32, as F.cross_entropy would upcast them
        if autocast or low:
            logits.copy_(F.linear(xc, weight))
        else:
            torch.mm(xc, weight.t(), out=logits)
        if n_valid < logits.size(1):
            logits[:, n_valid:] = float("-inf")
        valid = tc != IGNORE
        safe_tc = tc.clamp(min=0).unsqueeze(1)  # an index for every row; ignored rows are masked below
        target_logit = logits.gather(1, safe_tc).squeeze(1)
        # logsumexp and the softmax in place: exp(logits - max), its row sums, then / sum.
        row_max = logits.amax(dim=1, keepdim=True)
        sums = logits.sub_(row_max).exp_().sum(dim=1, keepdim=True)
        lse = (row_max + sums.log()).squeeze(1)
        losses[start:start + rows] = torch.where(valid, lse - target_logit, 0.0)
        if not (need_x or need_w):
            continue
        # d loss / d logits = softmax - one_hot(target); an ignored row contributes no gradient (x 0).
        logits.mul_(torch.where(valid.unsqueeze(1), sums.reciprocal(), 0.0))
        logits.scatter_add_(1, safe_tc, -valid.unsqueeze(1).to(logits.dtype))
        grad_logits = logits if low is None else logits.to(low)
        if need_x:
            grad_x[start:start + rows] = grad_logits @ weight
        if need_w:
            if autocast or low:
                grad_w += grad_logits.t() @ xc
            else:
                grad_w.addmm_(logits.t(), xc)
    return _Walk(losses, grad_x, None if grad_w is None else grad_w.to(weight.dtype))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, n_valid: int,
                mean: bool, rows: int) -> torch.Tensor:
        walk = _walk(x, weight, targets, n_valid, rows, need_x=ctx.needs_input_grad[0], need_w=ctx.needs_input_grad[1])
        loss = walk.losses.sum()
        count = (targets != IGNORE).sum().to(torch.float32)
        ctx.mean = mean
        ctx.save_for_backward(walk.grad_x, walk.grad_w, count)
        return loss / count if mean else loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_w, count = ctx.saved_tensors
        scale = grad_loss / count if ctx.mean else grad_loss
        return (None if grad_x is None else grad_x * scale.to(grad_x.dtype),
                None if grad_w is None else grad_w * scale.to(grad_w.dtype), None, None, None, None)
