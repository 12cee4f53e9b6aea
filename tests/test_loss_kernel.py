"""The walk's Triton chunk (model/loss_kernel.py) against F.cross_entropy in fp64: per-row losses and both gradients,
in fp32 and bf16, with ignored targets, padded columns and several column blocks; and the walk through it.

Where it runs: on a GPU natively (gpu_acceptance's `tests` stage); on a CPU with Triton installed, in Triton's
interpreter (TRITON_INTERPRET=1), the same kernel line by line. Triton is not in the CPU install (a 286 MB wheel that
no CPU run uses), so CI skips this module; torch's CUDA wheels bring it, and the GPU window runs it.

Bounds: fp32 1e-5 relative (the fp32 walk's rounding, plus the kernel's block-wise sum); bf16: the loss within 2e-2
absolute and the gradients within 3e-2 of their largest entry, the logits' bf16 rounding (2^-8 relative on logits of
a few units) carried through a softmax and one more bf16 matmul.

Seen to catch (in the interpreter): the online rescale `d * exp(m - m_new)` dropped (every case with several blocks);
the one-hot not subtracted; the padding columns given gradient; an ignored row's gradient not zeroed."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
from torch.nn import functional as F

import model.loss
from data.tokenizer import IGNORE

# Slow: on a GPU its first call compiles the kernel (ptxas, a process of its own; ~7 s).
pytestmark = pytest.mark.slow
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed (torch's CUDA wheels bring it; the CPU install does not)",
                allow_module_level=True)
if DEVICE == "cpu":
    # The interpreter is chosen when triton.language is imported; a Triton imported earlier compiles for a GPU.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported without its interpreter: run this module in a process of its own",
                    allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
N_VALID, V, C, N = 1000, 1024, 48, 37  # GPT-2's padded vocabulary in small: 50,257 of 50,304 columns are real


@pytest.fixture
def kernel(monkeypatch):
    """model.loss_kernel (in Triton's interpreter without a GPU) with 256-column blocks: 4 per row."""
    import model.loss_kernel
    monkeypatch.setattr(model.loss_kernel, "BLOCK", 256)
    return model.loss_kernel


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g)
    w = torch.randn(V, C, generator=g) * 0.5
    t = torch.randint(0, N_VALID, (N,), generator=g)
    t[[3, 20]] = IGNORE
    return x.to(DEVICE), w.to(DEVICE), t.to(DEVICE)


def reference(x, w, t, dtype):
    """Per-row losses and the gradients of their sum, in fp64 from the logits rounded to `dtype` as the kernel
    sees them, the padding columns at -inf."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    logits = (x64.to(dtype) @ w64.to(dtype).t()).double()
    logits = torch.cat([logits[:, :N_VALID], torch.full_like(logits[:, N_VALID:], float("-inf"))], dim=1)
    losses = F.cross_entropy(logits, t, ignore_index=IGNORE, reduction="none")
    losses.sum().backward()
    return losses, x64.grad, w64.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunk_equals_cross_entropy_and_its_gradients(kernel, dtype):
    x, w, t = inputs()
    losses, grad_x, grad_w = kernel.loss_chunk(x, w, t, N_VALID, dtype, True, True)
    ref_losses, ref_x, ref_w = reference(x, w, t, dtype)
    assert grad_x.dtype == grad_w.dtype == dtype and losses.dtype == torch.float32
    assert (losses[[3, 20]] == 0).all()
    if dtype == torch.float32:
        torch.testing.assert_close(losses.double(), ref_losses, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad_x.double(), ref_x, rtol=1e-5, atol=1e-5 * ref_x.abs().max().item())
        torch.testing.assert_close(grad_w.double(), ref_w, rtol=1e-5, atol=1e-5 * ref_w.abs().max().item())
    else:
        assert (losses.double() - ref_losses).abs().max() < 2e-2
        assert (grad_x.double() - ref_x).abs().max() < 3e-2 * ref_x.abs().max()
        assert (grad_w.double() - ref_w).abs().max() < 3e-2 * ref_w.abs().max()


def test_only_the_gradients_asked_for(kernel):
    x, w, t = inputs(1)
    losses, grad_x, grad_w = kernel.loss_chunk(x, w, t, N_VALID, torch.float32, False, True)
    assert grad_x.numel() == 0 and grad_w.shape == w.shape
    torch.testing.assert_close(losses.double(), reference(x, w, t, torch.float32)[0], rtol=1e-5, atol=1e-5)


def test_the_walk_takes_the_kernel_where_it_runs(kernel, monkeypatch):
    """chunked_cross_entropy on the kernel's path (forced on a CPU): the loss and both gradients equal the torch walk's
    and the full logits', over 3 chunks, with the mean over the non-ignored targets; evaluation's per-token losses
    (no gradients) take the kernel too and equal the torch walk's."""
    calls = []
    monkeypatch.setattr(model.loss, "fused_chunks", lambda device_type: True)
    monkeypatch.setattr(kernel, "_loss_and_grad_rows", _counting(kernel._loss_and_grad_rows, calls))
    x, w, t = inputs(2)

    def run(rows):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = model.loss.cross_entropy(xg, wg, t, N_VALID, "mean", rows)
        loss.backward()
        return loss.detach(), xg.grad, wg.grad

    fused = run(16)
    assert len(calls) == 3  # 37 rows in chunks of 16
    with torch.no_grad():  # evaluation's per-token losses take it too
        per_token = model.loss.chunked_cross_entropy(x, w, t, N_VALID, "none", 16)
    assert len(calls) == 6
    monkeypatch.setattr(model.loss, "fused_chunks", lambda device_type: False)
    for other in (run(16), run(0)):
        for a, b in zip(fused, other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(per_token, model.loss.chunked_cross_entropy(x, w, t, N_VALID, "none", 16))


def _counting(kernel_fn, calls):
    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel_fn[grid]
    return Counting()


def test_a_compiled_walk_through_the_kernel_is_one_graph(kernel, monkeypatch):
    """torch.compile(fullgraph=True) of the loss and its backward on the kernel's path: the custom op is one opaque
    call, and asking whether the kernel runs breaks no graph (`fused_chunks` is traced as a constant). On a GPU the
    real `fused_chunks` answers; on a CPU one marked the same way stands in for it.

    Seen on the H200 (torch 2.11): `has_triton` called in the traced walk, and the kernel's module imported there,
    8 graph breaks a step. Seen to catch, in the interpreter: a `has_triton()` call put back into the walk; a stand-in
    not marked constant that calls it."""
    if DEVICE == "cpu":
        monkeypatch.setattr(model.loss, "fused_chunks", torch.compiler.assume_constant_result(lambda device_type: True))
    x, w, t = inputs(3)
    torch._dynamo.reset()

    def run(fn):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(xg, wg)
        loss.backward()
        return loss.detach(), xg.grad, wg.grad

    def loss(x, w):
        return model.loss.cross_entropy(x, w, t, N_VALID, "mean", 16)

    got = run(torch.compile(loss, fullgraph=True, backend="aot_eager"))  # the backward compiled with the forward
    for a, b in zip(got, run(loss)):
        torch.testing.assert_close(a, b)
