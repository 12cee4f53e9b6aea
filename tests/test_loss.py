"""The training loss's two paths (model/loss.py) against F.cross_entropy over full logits: loss and gradients (hidden
states, output weight) in fp32 and under bf16 autocast, ignored targets, padded vocabulary, a frozen weight, the whole
GPT (tied embedding) and torch.compile; the path's default per device, the model's attribute and train.py's flag.

Bounds: fp32 1e-6 relative; the whole tied GPT 1e-5, with the loss and the final hidden states' gradient within the
rounding bound; bf16 autocast no further from fp32 than the plain bf16 path; bf16 parameters without autocast: an fp32
loss, bf16 gradients within 1e-2.

Seen to catch: the padding mask dropped (7 tests fail); the ignore mask dropped (7); the upstream gradient not applied
(2); ignored rows not zeroed (7); a 2% error in the bf16 weight gradient (2); the full path's fp32 upcast dropped (the 2
bf16-parameter cases)."""
from __future__ import annotations

import threading

import pytest
import torch
from torch.nn import functional as F

import model.loss
from common.errors import UserError, run_cli
from configs import ModelConfig, parse_config
from configs.schema import resume_rules
from model import GPT, GPTConfig
from model.loss import chunked_cross_entropy, cross_entropy, default_loss_chunk_rows, full_cross_entropy

N_VALID, V, C, N = 1000, 1024, 48, 50  # a padded vocabulary, as GPT-2's 50257 -> 50304
# The paths: the full logits, chunks of 7 rows (50 tokens: 7 full chunks and a short one), one chunk of them all.
PATHS = [0, 7, 512]
U32, U16 = 2.0 ** -24, 2.0 ** -8  # unit roundoffs: fp32 (24 significant bits), bf16 (8)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """7 rows per chunk where a path is not given (the CPU's default, evaluation): 50 tokens make 8 chunks."""
    monkeypatch.setattr(model.loss, "LOSS_CHUNK_ROWS", 7)


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g)
    w = torch.randn(V, C, generator=g) * 0.3
    targets = torch.randint(0, N_VALID, (N,), generator=g)
    targets[::5] = -100  # every fifth token ignored, across chunk borders
    return x, w, targets


UPSTREAM = 3.0  # an upstream gradient other than 1 must scale both gradients


def loss_and_grads(fn, x, w, targets, reduction, autocast=False):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(x, w, targets, reduction)
    (loss * UPSTREAM).backward()
    return loss.detach(), x.grad, w.grad


def plain(x, w, targets, reduction):
    bias = torch.zeros(V, dtype=x.dtype)
    bias[N_VALID:] = float("-inf")
    return F.cross_entropy(F.linear(x, w, bias), targets, ignore_index=-100, reduction=reduction)


def path(rows: int):
    """The loss on one path, as `GPT.forward` calls it."""
    return lambda x, w, targets, reduction: cross_entropy(x, w, targets, N_VALID, reduction, rows)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): a sum of n terms (or n roundings in a row) computed in floating point lies
    within gamma_n x (the sum of their magnitudes) of the exact sum, whatever the order (Accuracy and Stability of
    Numerical Algorithms, 2nd ed., Lemma 3.1 and eq. 3.5)."""
    return n * u / (1 - n * u)


def rounding_bounds(x, w, targets, n_valid, reduction, autocast, upstream=UPSTREAM):
    """The exact loss and gradients (float64) and, element by element, how far any computation of them in fp32
    (bf16 autocast: bf16 matmuls with fp32 sums, the softmax in fp32) may lie from them, to first order in the unit
    roundoffs. Both paths do the same arithmetic up to the order of their sums and where they round to bf16, so each
    lies within these bounds; the chunk walk only splits the sums over tokens into chunks, which gamma covers.

    With A = |x| |w|^T (the logits' magnitudes) and p the softmax:
    - a logit sums C products: |dz| <= dz_rel A, dz_rel = gamma_C(u32), under autocast + gamma_3(u16) (x and w
      rounded to bf16, the product rounded to bf16); E_i = max_v dz_rel A_iv bounds row i's logit errors.
    - a token's loss lse(z_i) - z_it: lse moves by at most max |dz| (it is 1-Lipschitz in the max norm), the target
      logit by at most as much, and the fp32 lse = m + log(sum exp(z - m)) itself rounds by R_i = gamma_{V+2}(u32)
      (exp, the sum over V, relative: absolute once through log) + 6 u32 (max_v |z_iv| + |lse_i|) (z - m, log, + m);
      the subtraction rounds by u32 |loss_i|; the mean or sum over tokens adds gamma_N(u32) of the summed losses.
    - the logits' gradient g = p - onehot (per counted token, x upstream / count for "mean"), p = exp(z - lse):
      |dp_iv| <= p_iv (2 E_i + R_i + u32), under autocast + u16 |g_iv| (rounded to bf16 for the backward's matmuls).
    - grad_x = g w and grad_w = g^T x: sum_v |dg_iv| |w_vc| (sum_i |dg_iv| |x_ic|) + (gamma over V (N) terms in
      fp32, + 2 u16 under autocast: w (x) rounded to bf16, the product rounded to bf16: per chunk, each chunk's sum
      bounded by its share of |g|^T |x|) x |g| |w| (|g|^T |x|), and one fp32 rounding of the upstream scale.
    Second-order terms (u16^2 ~ 1.5e-5 of the first) are covered by a factor 1.1."""
    x64, w64 = x.double(), w.double()
    (N, C), V = x.shape, w.size(0)
    valid = targets != -100
    count = valid.sum().item() if reduction == "mean" else 1
    scale = upstream / count
    z = x64 @ w64.T
    z[:, n_valid:] = float("-inf")
    lse = torch.logsumexp(z, dim=1)
    p = torch.softmax(z, dim=1)
    safe_t = targets.clamp(min=0)
    z_t = z.gather(1, safe_t.unsqueeze(1)).squeeze(1)
    losses = torch.where(valid, lse - z_t, 0.0)
    onehot = F.one_hot(safe_t, V).double()
    g = (p - onehot) * valid.unsqueeze(1) * scale  # d(upstream x loss) / d logits
    loss = losses.sum() / count

    bf16 = U16 if autocast else 0.0
    A = x64.abs() @ w64.abs().T
    A[:, n_valid:] = 0  # the padding columns: -inf, exactly, on both paths
    E = (gamma(C, U32) + gamma(3, bf16)) * A.amax(dim=1)
    R = gamma(V + 2, U32) + 6 * U32 * (z[:, :n_valid].abs().amax(dim=1) + lse.abs())
    softmax_rel = 2 * E + R + U32
    per_token = valid * (2 * E + R + U32 * (lse - z_t).abs())
    loss_bound = per_token.sum() / count + gamma(N, U32) * losses.abs().sum() / count
    dg = valid.unsqueeze(1) * scale * p * softmax_rel.unsqueeze(1) + bf16 * g.abs()
    grad_x_bound = dg @ w64.abs() + (gamma(V, U32) + 2 * bf16 + U32) * (g.abs() @ w64.abs())
    grad_w_bound = dg.T @ x64.abs() + (gamma(N, U32) + 2 * bf16 + U32) * (g.abs().T @ x64.abs())
    exact = (loss, g @ w64, g.T @ x64)
    return exact, tuple(1.1 * b for b in (loss_bound, grad_x_bound, grad_w_bound))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("rows", PATHS)
def test_both_paths_equal_cross_entropy_within_the_rounding_bound(rows, reduction, autocast):
    """Each path's loss, grad_x and grad_w lie within `rounding_bounds` (derived there) of the exact F.cross_entropy(
    F.linear(x, w), t) over the valid columns, element by element; ignored tokens and padding rows get exactly 0.

    Full logits (0), chunks of 7 rows of 50 tokens (the last short) and one chunk of 512, in fp32 and under bf16
    autocast, with ignored targets and padding columns; seen up to 0.53 of the bound. The fp32 bound is 1/128 of what a
    dropped padding mask moves the loss (`test_the_bound_is_tight_enough_to_see_a_dropped_padding_mask`).

    Seen to catch: the full path's -inf padding bias dropped: the 4 full-path cases fail (and 11 other full-path tests).
    Its `reduction` not passed on: the 2 "sum" cases (7 tests in all)."""
    x, w, targets = inputs(4)
    ours = loss_and_grads(path(rows), x, w, targets, reduction, autocast)
    exact, bounds = rounding_bounds(x, w, targets, N_VALID, reduction, autocast)
    for name, a, e, b in zip(("loss", "grad x", "grad weight"), ours, exact, bounds):
        gap = (a.double() - e).abs()
        assert (gap <= b).all(), f"{name}: {(gap / b).max().item():.3g} x its bound"
    assert ours[2][N_VALID:].abs().max() == 0  # the padding rows get no gradient
    assert (ours[1][::5] == 0).all()  # nor do the ignored tokens' hidden states


def test_the_bound_is_tight_enough_to_see_a_dropped_padding_mask():
    """The fp32 bound is not vacuous: the padding columns given probability (their -inf bias left out) moves the loss
    far beyond it (24 of 1,024 columns: 0.024 here, 128 times the bound, 1.9e-4)."""
    x, w, targets = inputs(4)
    exact, bounds = rounding_bounds(x, w, targets, N_VALID, "mean", autocast=False)
    unmasked = F.cross_entropy(F.linear(x, w), targets, ignore_index=-100)
    assert (unmasked.double() - exact[0]).abs() > 100 * bounds[0]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("rows", PATHS)
def test_fp32_equals_plain_cross_entropy(rows, reduction):
    x, w, targets = inputs()
    ref, ours = loss_and_grads(plain, x, w, targets, reduction), loss_and_grads(path(rows), x, w, targets, reduction)
    for name, a, b in zip(("loss", "grad x", "grad weight"), ours, ref):
        assert rel_err(a, b) <= 1e-6, name
    assert ours[2][N_VALID:].abs().max() == 0  # the padding rows get no gradient
    assert (ours[1][::5] == 0).all()  # nor do the ignored tokens' hidden states


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("rows", PATHS)
def test_bf16_autocast_matches_plain_within_bf16_rounding(rows, reduction):
    """Both run the matmuls in bf16 and the softmax in fp32; they round at different places (the plain
    path rounds the scaled logits gradient, the chunked one the unscaled one), so they agree to bf16's
    precision, not bit for bit. Each is as close to the fp32 result as the other."""
    x, w, targets = inputs(1)
    exact = loss_and_grads(plain, x, w, targets, reduction)
    ref = loss_and_grads(plain, x, w, targets, reduction, autocast=True)
    ours = loss_and_grads(path(rows), x, w, targets, reduction, autocast=True)
    for name, a, b, e in zip(("loss", "grad x", "grad weight"), ours, ref, exact):
        assert a.dtype == b.dtype, name
        assert rel_err(a, b) <= 1e-2, name
        assert rel_err(a, e) <= 1.5 * rel_err(b, e) + 1e-3, name


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("rows", PATHS)
def test_bf16_parameters_without_autocast_match_plain_within_bf16_rounding(rows, reduction):
    """DeepSpeed's bf16: the hidden states and the output weight are bf16 themselves, no autocast (a matmul into the
    fp32 logits buffer would fail; the full logits are upcast for the softmax). Gradients come back in bf16, as close
    to the fp32 result as bf16 autocast's."""
    x, w, targets = inputs(2)
    exact = loss_and_grads(plain, x, w, targets, reduction)
    ours = loss_and_grads(path(rows), x.bfloat16(), w.bfloat16(), targets, reduction)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == ours[2].dtype == torch.bfloat16
    for name, a, e in zip(("loss", "grad x", "grad weight"), ours, exact):
        assert rel_err(a, e) <= 1e-2, name


@pytest.mark.parametrize("rows", PATHS)
def test_large_logits_stay_finite_and_exact(rows):
    """Logits in the hundreds (exp overflows fp32 beyond 88): the softmax is taken relative to each row's max.

    Seen to catch: the row max not subtracted (`* 0`): only this test fails."""
    x, w, targets = inputs(3)
    x = x * 100
    ref, ours = loss_and_grads(plain, x, w, targets, "mean"), loss_and_grads(path(rows), x, w, targets, "mean")
    for name, a, b in zip(("loss", "grad x", "grad weight"), ours, ref):
        assert torch.isfinite(a).all() and rel_err(a, b) <= 1e-6, name


@pytest.mark.parametrize("rows", PATHS)
def test_frozen_weight_gets_no_gradient_and_x_still_does(rows):
    x, w, targets = inputs(2)
    xr = x.clone().requires_grad_()
    plain(xr, w, targets, "mean").backward()
    xc = x.clone().requires_grad_()
    path(rows)(xc, w, targets, "mean").backward()
    assert rel_err(xc.grad, xr.grad) <= 1e-6 and w.grad is None


@pytest.mark.parametrize("rows, chunks", [(7, [7] * 7 + [1]), (16, [16, 16, 16, 2]), (512, [50]), (0, [50])])
def test_the_walk_takes_the_rows_it_is_given(rows, chunks):
    """The logits are computed N token rows at a time (50 tokens: the last chunk short), or all at once for 0: every
    tensor of V columns the forward makes has that many rows.

    Seen to catch: the walk ignoring its N (`rows = LOSS_CHUNK_ROWS`): 2 cases fail, while every numeric test passed
    it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class LogitRows(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default):
                seen.append(out.size(0) if out.size(-1) == V else None)
            return out

    x, w, targets = inputs()
    with torch.no_grad(), LogitRows():
        cross_entropy(x, w, targets, N_VALID, "sum", rows)
    assert [n for n in seen if n is not None] == chunks


def test_a_cpu_walk_keeps_its_logits_buffer_for_the_next():
    """On a CPU the walk allocates its (rows x V) logits buffer once and keeps it: the next walk, with gradients or
    without, allocates none; a walk of more rows grows it once; a thread gets its own. The values stay plain
    cross-entropy's (every test here runs through the kept buffer). A fresh buffer each walk cost the default run
    16% of its CPU time: glibc maps a block that large anew, and its first write zero-fills every page.

    Seen to catch: `_logits_buffer` allocating a new buffer on every call: the second walk allocates one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        rows: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.empty.memory_format and out.numel() and out.numel() % V == 0:
                self.rows.append(out.numel() // V)
            return out

    def walk(x, w, targets, rows, grad: bool) -> list[int]:
        x, w = x.clone().requires_grad_(grad), w.clone().requires_grad_(grad)
        with Allocations() as seen:
            seen.rows = []
            loss = cross_entropy(x, w, targets, N_VALID, "sum", rows)
        assert rel_err(loss, plain(x, w, targets, "sum")) <= 1e-6  # the fp32 bound of the tests above
        return seen.rows

    x, w, targets = inputs()
    model.loss._held.buffer = None  # as in a new process
    assert walk(x, w, targets, 7, grad=True) == [7]
    assert walk(x, w, targets, 7, grad=True) == [] and walk(x, w, targets, 7, grad=False) == []
    assert walk(x, w, targets, 16, grad=False) == [16] and walk(x, w, targets, 7, grad=True) == []
    main = model.loss._held.buffer
    other = []
    thread = threading.Thread(target=lambda: other.append(walk(x, w, targets, 7, grad=False)))
    thread.start()
    thread.join()
    assert other == [[7]] and model.loss._held.buffer is main


def test_bad_reduction_and_bad_path():
    x, w, targets = inputs()
    for fn in (chunked_cross_entropy, full_cross_entropy):
        with pytest.raises(ValueError, match="'mean', 'sum' or 'none'"):
            fn(x, w, targets, N_VALID, "max")
    with pytest.raises(ValueError, match="gives no gradients"):  # a per-token loss's backward is not kept
        chunked_cross_entropy(x, w.requires_grad_(), targets, N_VALID, "none")
    with pytest.raises(ValueError, match="must be 0 .* not -1"):
        cross_entropy(x, w, targets, N_VALID, "mean", -1)


@pytest.mark.parametrize("rows", PATHS)
def test_per_token_losses_without_gradients_equal_plain_cross_entropy(rows):
    """Evaluation's reduction "none" (HellaSwag scores each token): the plain per-token losses, 0 where ignored."""
    x, w, targets = inputs(2)
    with torch.no_grad():
        ours = cross_entropy(x.view(5, 10, C), w, targets.view(5, 10), N_VALID, "none", rows)
    ref = plain(x, w, targets, "none").view(5, 10)
    assert ours.shape == (5, 10) and ours.dtype == torch.float32
    assert rel_err(ours, ref) <= 1e-6
    assert (ours.view(-1)[::5] == 0).all()


def test_the_default_path_by_device_type(monkeypatch):
    """Chunks of LOSS_CHUNK_ROWS on the CPU, of KERNEL_CHUNK_ROWS on CUDA (the full logits there without Triton),
    the full logits on other accelerators; resolved from the tensors' device when no path is given (a "meta" tensor
    stands for another accelerator's).

    `loss_chunk_rows` None is resolved at each forward from the hidden states' device; a value set afterwards is taken
    by the next forward (`test_the_model_resolves_its_default_from_the_device_it_runs_on`).

    Seen to catch: 512 on every device: both fail (and the planner's hand-computed paths). `GPT.forward` passing None
    instead of its attribute: the second fails. 0 dispatched to the walk: 20 tests fail."""
    assert default_loss_chunk_rows("cpu") == model.loss.LOSS_CHUNK_ROWS == 7  # (this file's fixture)
    assert default_loss_chunk_rows("cuda") == model.loss.KERNEL_CHUNK_ROWS == 65536
    assert default_loss_chunk_rows("xpu") == default_loss_chunk_rows("mps") == 0
    monkeypatch.setattr(model.loss, "fused_chunks", lambda device_type: False)  # a CUDA torch without Triton
    assert model.loss.loss_chunk_rows_on("cuda", None) == 0 and model.loss.loss_chunk_rows_on("cuda", 512) == 512
    monkeypatch.setattr(model.loss, "fused_chunks", lambda device_type: device_type == "cuda")
    assert model.loss.loss_chunk_rows_on("cuda", None) == 65536 and model.loss.loss_chunk_rows_on("cpu", None) == 7
    assert model.loss.describe_loss_path(65536, "cuda") == "loss: 65536-row chunks (Triton)"
    assert model.loss.describe_loss_path(7, "cpu") == "loss: 7-row chunks"
    x, w, targets = inputs()
    taken = []
    monkeypatch.setattr(model.loss, "full_cross_entropy", lambda *a: taken.append("full"))
    monkeypatch.setattr(model.loss, "chunked_cross_entropy", lambda *a: taken.append(a[-1]))
    cross_entropy(x, w, targets, N_VALID)
    cross_entropy(x.to("meta"), w.to("meta"), targets.to("meta"), N_VALID)
    assert taken == [7, "full"]


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


@pytest.fixture
def loss_path(gpt_and_batch):
    """Sets the module-scoped GPT's `loss_chunk_rows` for one test, then back to None (the device's default)."""
    gpt = gpt_and_batch[0]
    yield lambda rows: setattr(gpt, "loss_chunk_rows", rows)
    gpt.loss_chunk_rows = None


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("rows", [None, *PATHS])
def test_gpt_training_loss_and_every_gradient_equal_the_full_logits_path(gpt_and_batch, loss_path, rows, reduction):
    """`all_logits=True` takes the plain path; the tied wte/lm_head weight sums both gradients. Each `loss_chunk_rows`
    (None: the CPU's default, here 7 rows; 48 tokens) gives the loss and the final hidden states' gradient within
    `rounding_bounds` of the exact ones (computed from those hidden states); the blocks' backward passes that
    gradient on with its own fp32 rounding: 1e-5 relative per parameter gradient (seen: under 1e-6)."""
    gpt, x, y = gpt_and_batch
    ref_loss, ref = gpt_loss_and_grads(gpt, x, y, loss_reduction=reduction, all_logits=True)
    loss_path(rows)
    hidden = []
    hook = gpt.transformer.ln_f.register_forward_hook(lambda m, i, out: hidden.append(out) or out.retain_grad())
    try:
        loss, ours = gpt_loss_and_grads(gpt, x, y, loss_reduction=reduction)
    finally:
        hook.remove()
    h, grad_h = (t.view(-1, gpt.config.n_embd) for t in (hidden[0].detach(), hidden[0].grad))
    exact, bounds = rounding_bounds(h, gpt.lm_head.weight.detach(), y.view(-1), gpt.config.vocab_size, reduction,
                                    autocast=False, upstream=1.0)
    assert (loss.double() - exact[0]).abs() <= bounds[0]
    assert ((grad_h.double() - exact[1]).abs() <= bounds[1]).all()
    assert rel_err(loss, ref_loss) <= 1e-6
    for name in ref:
        assert rel_err(ours[name], ref[name]) <= 1e-5, name


@pytest.mark.parametrize("rows", [None, 0])
def test_gpt_under_torch_compile(gpt_and_batch, loss_path, rows):
    """Dynamo traces either path into the graph, no break: the chunk walk's autograd.Function, or the full logits'
    F.cross_entropy inside the compiled region (backend "eager": the tracing, not inductor's code generation, which
    takes ~45 s on a small CPU)."""
    gpt, x, y = gpt_and_batch
    ref_loss, ref = gpt_loss_and_grads(gpt, x, y, all_logits=True)
    loss_path(rows)
    torch._dynamo.reset()
    loss, ours = gpt_loss_and_grads(gpt, x, y, forward=torch.compile(gpt, backend="eager", fullgraph=True))
    assert rel_err(loss, ref_loss) <= 1e-6
    for name in ref:
        assert rel_err(ours[name], ref[name]) <= 1e-5, name


@pytest.mark.parametrize("rows", [None, 0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gpt_evaluation_loss_is_chunked_in_fp32_and_equals_the_full_logits_path(gpt_and_batch, loss_path, reduction,
                                                                                rows, monkeypatch):
    """Evaluation (eval mode, no grad, under bf16 autocast as a bf16 run evaluates): the chunked walk whatever the
    training path, never the full logits (F.cross_entropy is not called), with the output layer in fp32 as
    `all_logits` computes it.

    "mean", "sum" and per-token "none" equal the full-logits path within 1e-6; "none" without gradients equals the plain
    per-token losses, 0 at ignored targets (`test_per_token_losses_without_gradients_equal_plain_cross_entropy`), and
    with gradients is refused by the walk (`test_bad_reduction_and_bad_path`).

    Seen to catch: the chunked path taken in training only: the 3 evaluation cases fail ("full logits in evaluation").
    Evaluation on the training path (`if True:`): the 6 cases fail."""
    gpt, x, y = gpt_and_batch
    loss_path(rows)
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


def test_the_model_resolves_its_default_from_the_device_it_runs_on(monkeypatch):
    """A GPT is built on the CPU and moved: `loss_chunk_rows` None is resolved at each forward from the hidden states'
    device, so the same model walks chunks on the CPU and takes the full logits once moved to an accelerator (the
    "meta" device here); a value set afterwards (a benchmark's variant) is what the next forward takes."""
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=100)).train()
    assert gpt.loss_chunk_rows is None
    x = torch.randint(0, 100, (2, 8))
    taken = []
    monkeypatch.setattr(model.gpt, "cross_entropy", lambda *a: taken.append(a[-1]) or cross_entropy(*a))
    monkeypatch.setattr(model.loss, "full_cross_entropy", lambda *a: taken.append("full") or torch.zeros(()))
    monkeypatch.setattr(model.loss, "chunked_cross_entropy", lambda *a: taken.append("chunks") or torch.zeros(()))
    gpt(x, x)
    gpt.to("meta")(x.to("meta"), x.to("meta"))
    gpt.loss_chunk_rows = 512
    gpt(x.to("meta"), x.to("meta"))
    assert taken == [None, "chunks", None, "full", 512, "chunks"]


def test_the_pipelines_last_stage_takes_the_models_path(monkeypatch):
    """`GPTStage` (model/pipeline.py) carries the model's `loss_chunk_rows` and its loss takes that path in training,
    the chunk walk in evaluation.

    Seen to catch: `GPTStage` not copying it (None): fails."""
    from model.pipeline import GPTStage

    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=100))
    gpt.loss_chunk_rows = 0
    stage = GPTStage(gpt, 1, 2).train()
    assert stage.loss_chunk_rows == 0
    taken = []
    monkeypatch.setattr(model.loss, "full_cross_entropy", lambda *a: taken.append("full"))
    monkeypatch.setattr(model.loss, "chunked_cross_entropy", lambda *a: taken.append(a[-1]))
    monkeypatch.setattr(model.pipeline, "chunked_cross_entropy", lambda *a: taken.append("evaluation"))
    hidden, targets = torch.randn(2, 8, 16), torch.randint(0, 100, (2, 8))
    stage.loss(hidden, targets)
    stage.loss_chunk_rows = 16
    stage.loss(hidden, targets)
    stage.eval().loss(hidden, targets)
    assert taken == ["full", 16, "evaluation"]


def test_the_flag_parses_is_refused_when_negative_and_reaches_the_model(capsys):
    """--loss_chunk_rows: None by default (the device's), 0 and N as given, changeable on a resume (ACCEPTED); a
    negative value is one line and exit status 2; build_model puts it on the GPT.

    It is in config.yaml's keys; the run header says `loss: 512-row chunks` or `loss: full logits` (checked by hand with
    `python train.py --max_steps 3 [--loss_chunk_rows 0]`, as was a resume changing it).

    Seen to catch: `build_model` not setting it; the schema's check removed: each fails."""
    from common.resume_rules import ACCEPTED
    from training.network import build_model

    assert parse_config([]).training.loss_chunk_rows is None
    assert parse_config(["--loss_chunk_rows", "0"]).training.loss_chunk_rows == 0
    cfg = parse_config(["--loss_chunk_rows", "16384"])
    assert cfg.training.loss_chunk_rows == 16384 and cfg.flat()["loss_chunk_rows"] == 16384  # config.yaml's keys
    assert resume_rules()["loss_chunk_rows"] == ACCEPTED
    with pytest.raises(UserError, match=r"--loss_chunk_rows must be 0 \(the full logits\) .* got -1; pass 0 or e.g."):
        parse_config(["--loss_chunk_rows", "-1"])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: parse_config(["--loss_chunk_rows", "-1"]))
    assert exit_info.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    small = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)
    for rows in (None, 0, 512):
        assert build_model(small, None, loss_chunk_rows=rows)[0].loss_chunk_rows == rows
