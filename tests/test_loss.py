"""The chunked cross-entropy (model/loss.py) against the plain F.cross_entropy over full logits: loss and
gradients (hidden states, output weight) in fp32 and under bf16 autocast, ignored targets, padded
vocabulary, a frozen weight, the whole GPT (tied embedding) and torch.compile."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import model.loss
from model import GPT, GPTConfig
from model.loss import chunked_cross_entropy

N_VALID, V, C, N = 1000, 1024, 48, 50  # a padded vocabulary, as GPT-2's 50257 -> 50304


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """7 rows per chunk: 50 tokens make 8 chunks, the last one short."""
    monkeypatch.setattr(model.loss, "LOSS_CHUNK_ROWS", 7)


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g)
    w = torch.randn(V, C, generator=g) * 0.3
    targets = torch.randint(0, N_VALID, (N,), generator=g)
    targets[::5] = -100  # every fifth token ignored, across chunk borders
    return x, w, targets


def loss_and_grads(fn, x, w, targets, reduction, autocast=False):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(x, w, targets, reduction)
    (loss * 3.0).backward()  # an upstream gradient other than 1 must scale both gradients
    return loss.detach(), x.grad, w.grad


def plain(x, w, targets, reduction):
    bias = torch.zeros(V)
    bias[N_VALID:] = float("-inf")
    return F.cross_entropy(F.linear(x, w, bias), targets, ignore_index=-100, reduction=reduction)


def chunked(x, w, targets, reduction):
    return chunked_cross_entropy(x, w, targets, N_VALID, reduction)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp32_equals_plain_cross_entropy(reduction):
    x, w, targets = inputs()
    ref, ours = loss_and_grads(plain, x, w, targets, reduction), loss_and_grads(chunked, x, w, targets, reduction)
    for name, a, b in zip(("loss", "grad x", "grad weight"), ours, ref):
        assert rel_err(a, b) <= 1e-6, name
    assert ours[2][N_VALID:].abs().max() == 0  # the padding rows get no gradient
    assert (ours[1][::5] == 0).all()  # nor do the ignored tokens' hidden states


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bf16_autocast_matches_plain_within_bf16_rounding(reduction):
    """Both run the matmuls in bf16 and the softmax in fp32; they round at different places (the plain
    path rounds the scaled logits gradient, the chunked one the unscaled one), so they agree to bf16's
    precision, not bit for bit. Each is as close to the fp32 result as the other."""
    x, w, targets = inputs(1)
    exact = loss_and_grads(plain, x, w, targets, reduction)
    ref = loss_and_grads(plain, x, w, targets, reduction, autocast=True)
    ours = loss_and_grads(chunked, x, w, targets, reduction, autocast=True)
    for name, a, b, e in zip(("loss", "grad x", "grad weight"), ours, ref, exact):
        assert a.dtype == b.dtype, name
        assert rel_err(a, b) <= 1e-2, name
        assert rel_err(a, e) <= 1.5 * rel_err(b, e) + 1e-3, name


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bf16_parameters_without_autocast_match_plain_within_bf16_rounding(reduction):
    """DeepSpeed's bf16: the hidden states and the output weight are bf16 themselves, no autocast (a matmul into the
    fp32 logits buffer would fail). Gradients come back in bf16, as close to the fp32 result as bf16 autocast's."""
    x, w, targets = inputs(2)
    exact = loss_and_grads(plain, x, w, targets, reduction)
    ours = loss_and_grads(chunked, x.bfloat16(), w.bfloat16(), targets, reduction)
    assert ours[1].dtype == ours[2].dtype == torch.bfloat16
    for name, a, e in zip(("loss", "grad x", "grad weight"), ours, exact):
        assert rel_err(a, e) <= 1e-2, name


def test_large_logits_stay_finite_and_exact():
    """Logits in the hundreds (exp overflows fp32 beyond 88): the softmax is taken relative to each row's max."""
    x, w, targets = inputs(3)
    x = x * 100
    ref, ours = loss_and_grads(plain, x, w, targets, "mean"), loss_and_grads(chunked, x, w, targets, "mean")
    for name, a, b in zip(("loss", "grad x", "grad weight"), ours, ref):
        assert torch.isfinite(a).all() and rel_err(a, b) <= 1e-6, name


def test_frozen_weight_gets_no_gradient_and_x_still_does():
    x, w, targets = inputs(2)
    xr = x.clone().requires_grad_()
    plain(xr, w, targets, "mean").backward()
    xc = x.clone().requires_grad_()
    chunked(xc, w, targets, "mean").backward()
    assert rel_err(xc.grad, xr.grad) <= 1e-6


def test_bad_reduction():
    x, w, targets = inputs()
    with pytest.raises(ValueError, match="'mean', 'sum' or 'none'"):
        chunked_cross_entropy(x, w, targets, N_VALID, "max")
    with pytest.raises(ValueError, match="gives no gradients"):  # a per-token loss's backward is not kept
        chunked_cross_entropy(x, w.requires_grad_(), targets, N_VALID, "none")


def test_per_token_losses_without_gradients_equal_plain_cross_entropy():
    """Evaluation's reduction "none" (HellaSwag scores each token): the plain per-token losses, 0 where ignored."""
    x, w, targets = inputs(2)
    with torch.no_grad():
        ours = chunked_cross_entropy(x.view(5, 10, C), w, targets.view(5, 10), N_VALID, "none")
    ref = plain(x, w, targets, "none").view(5, 10)
    assert ours.shape == (5, 10) and ours.dtype == torch.float32
    assert rel_err(ours, ref) <= 1e-6
    assert (ours.view(-1)[::5] == 0).all()


@pytest.fixture(scope="module")
def gpt_and_batch():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=1000))  # 1024 rows
    x = torch.randint(0, 1000, (3, 16))
    y = torch.randint(0, 1000, (3, 16))
    y[0, :5] = -100
    return gpt.train(), x, y


def gpt_loss_and_grads(gpt, x, y, forward=None, **kwargs):
    gpt.zero_grad(set_to_none=True)
    _, loss = (gpt if forward is None else forward)(x, y, **kwargs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in gpt.named_parameters()}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gpt_training_loss_and_every_gradient_equal_the_full_logits_path(gpt_and_batch, reduction):
    """`all_logits=True` takes the plain path; the tied wte/lm_head weight sums both gradients."""
    gpt, x, y = gpt_and_batch
    ref_loss, ref = gpt_loss_and_grads(gpt, x, y, loss_reduction=reduction, all_logits=True)
    loss, ours = gpt_loss_and_grads(gpt, x, y, loss_reduction=reduction)
    assert rel_err(loss, ref_loss) <= 1e-6
    for name in ref:
        assert rel_err(ours[name], ref[name]) <= 1e-5, name


def test_gpt_under_torch_compile(gpt_and_batch):
    """Dynamo traces the autograd.Function into the graph, no break (backend "eager": the tracing, not
    inductor's code generation, which takes ~45 s on a small CPU)."""
    gpt, x, y = gpt_and_batch
    ref_loss, ref = gpt_loss_and_grads(gpt, x, y)
    torch._dynamo.reset()
    loss, ours = gpt_loss_and_grads(gpt, x, y, forward=torch.compile(gpt, backend="eager", fullgraph=True))
    assert rel_err(loss, ref_loss) <= 1e-6
    for name in ref:
        assert rel_err(ours[name], ref[name]) <= 1e-5, name


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gpt_evaluation_loss_is_chunked_in_fp32_and_equals_the_full_logits_path(gpt_and_batch, reduction,
                                                                                monkeypatch):
    """Evaluation (eval mode, no grad, under bf16 autocast as a bf16 run evaluates): the chunked walk, never the
    full logits (F.cross_entropy is not called), with the output layer in fp32 as `all_logits` computes it."""
    gpt, x, y = gpt_and_batch
    gpt.eval()
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            _, ref = gpt(x, y, loss_reduction=reduction, all_logits=True)
            monkeypatch.setattr(F, "cross_entropy", lambda *a, **k: pytest.fail("full logits in evaluation"))
            _, ours = gpt(x, y, loss_reduction=reduction)
    finally:
        gpt.train()
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert rel_err(ours, ref) <= 1e-6
