"""How far apart two runs of one recipe may end when they add the same numbers in another order, and why.

Runs compared "to float rounding" (other process counts, a sharding engine, tensor parallelism, nodes, accumulation
against a larger micro-batch) compute the same gradients up to the order of their fp32 sums. That order depends on
how the work is split and on the CPU's kernels: AVX2, AVX-512 and AMX machines block their loops differently, so
the rounding, and which elements it matters for, changes from machine to machine. What AdamW then does with it:

- An element whose gradient stands well clear of its rounding error gets nearly the same update in both runs. These
  agree to SIGNAL_ATOL.
- An element whose gradient is, at some step, within its rounding error of zero gets an update whose size and sign
  are rounding: AdamW divides by sqrt(v), so a gradient of 1e-12 moves the weight as far as one of 1e-3. Such
  elements are rare, and where they fall depends on the CPU (2026-11-26, tensor parallelism 2 against one process:
  `wte[10110, 27]` 1.19e-6 apart on an AMD Zen 4 with AVX-512, one element of 1,608,224 on an Intel Xeon with AMX;
  every other element within 6e-7). Each is bounded only by AdamW itself: `adamw_drift_bound`.
- The key biases (rows C..2C of each `c_attn.bias`) are all such elements: their exact gradient is zero (q . b_k is
  the same for every key of a query, and softmax ignores a shift), so what reaches them is rounding alone.

A bug (a gradient not reduced, a rank reading another's batch, a lost micro-step, a wrong scale) changes most
elements of most tensors by about an update, far more than `rare_outliers` allows.
"""
from __future__ import annotations

import math

# Elements whose gradients carry signal: 1e-6 is 8 fp32 spacings of a LayerNorm weight (1.0, the largest weights
# here) and 1/1000 of an update at lr 1e-3: what an element moves apart when its gradient's relative rounding error
# stays under 1e-3 at every step. Seen at most 6e-7 (FSDP2, ZeRO-1/2/3, TP 2, DDP: Zen 4, 2026-11-26).
SIGNAL_ATOL = 1e-6


def rare_outliers(numel: int) -> int:
    """How many elements of a tensor of `numel` may lie beyond SIGNAL_ATOL: one per tensor, plus one per 100,000
    elements (the vocabulary's embedding: 17). Rounding put one there in 1.6M (above); a bug puts most of them."""
    return 1 + numel // 100_000


def adamw_step_bound(beta1: float, beta2: float, step: int) -> float:
    """The largest |m_hat / sqrt(v_hat)| AdamW's step `step` (1-based) can take, whatever the gradients were.

    m = (1 - b1) sum_k b1^k g_k and v = (1 - b2) sum_k b2^k g_k^2 over the last `step` gradients; by Cauchy-Schwarz
    |sum_k b1^k g_k| <= sqrt(sum_k (b1^2 / b2)^k) sqrt(sum_k b2^k g_k^2), which with the bias corrections gives
    (1 - b1) / (1 - b1^t) * sqrt(sum_{k<t} (b1^2 / b2)^k) * sqrt((1 - b2^t) / (1 - b2)). It is 1 at the first step
    and tends to 1.165 for the defaults (0.9, 0.95): the "|update| <= lr" of the Adam paper is a rule of thumb, not a
    bound. (b1^2 / b2 < 1 holds for every beta pair in use: 0.81 / 0.95 here.)"""
    ratio = beta1 * beta1 / beta2
    weights = sum(ratio ** k for k in range(step))
    return (1 - beta1) / (1 - beta1 ** step) * math.sqrt(weights) * math.sqrt((1 - beta2 ** step) / (1 - beta2))


def adamw_drift_bound(lr: float, beta1: float, beta2: float, steps: int) -> float:
    """The furthest apart one element of two AdamW runs from the same weights can end after `steps` steps at
    learning rates up to `lr` (the schedule's peak), whatever their gradients: each step moves it by at most
    lr x `adamw_step_bound` (eps only shrinks the step), in opposite directions in the worst case, and the
    decoupled weight decay w <- w (1 - lr wd) shrinks a difference rather than growing it."""
    return 2 * lr * sum(adamw_step_bound(beta1, beta2, t) for t in range(1, steps + 1))


def weights_apart_by_rounding(a: dict, b: dict, config: dict, atol: float = SIGNAL_ATOL) -> list[str]:
    """What keeps the weights `a` and `b` (name -> tensor) of two AdamW runs of `config` (a run's config.yaml) from
    being equal to float rounding, as the module's docstring reasons: empty when they are.

    Per tensor: every element within `adamw_drift_bound`; beyond `atol`, at most `rare_outliers` elements, the key
    biases set apart (all of them are rounding). `atol` larger than SIGNAL_ATOL for runs in other precisions."""
    import torch

    drift = adamw_drift_bound(config["lr"], config["beta1"], config["beta2"], config["max_steps"])
    problems = []
    for name in a:
        gap = (a[name].float() - b[name].float()).abs().flatten()
        if name.endswith("attn.c_attn.bias"):
            C = gap.numel() // 3
            keys, gap = gap[C:2 * C], torch.cat([gap[:C], gap[2 * C:]])
            if float(keys.max()) > drift:
                problems.append(f"{name}: key biases {float(keys.max()):.3g} apart, beyond AdamW's {drift:.3g}")
        worst, beyond = float(gap.max()), int((gap > atol).sum())
        if worst > drift:
            problems.append(f"{name}: {worst:.3g} apart, beyond AdamW's {drift:.3g} (no rounding moves it so far)")
        elif beyond > rare_outliers(gap.numel()):
            problems.append(f"{name} differs: {beyond} of {gap.numel()} elements beyond {atol:g} (max {worst:.3g}); "
                            f"rounding leaves at most {rare_outliers(gap.numel())}")
    return problems


# The logged numbers of two such runs.
# The loss (~10.8 for the tiny model) is a mean of fp32 per-token losses: summed in another order it moves by a few
# of its fp32 spacings (9.5e-7 at 10.8; seen 1 spacing). 1e-6 relative is 11 spacings.
LOSS_RTOL = 1e-6
# The gradient norm (before clipping) sums 1.66M squares in an order each engine picks (per shard, per bucket), of
# gradients that drift apart with the weights: seen 3e-5 (FSDP2) and 6e-5 (ZeRO) relative by step 4, growing about
# 2x a step. A bug in what is measured (one rank's shard, a sum before the reduction, micro-steps unscaled) is off by
# a factor (1.4x and more). 1e-3 is 16x the rounding seen.
GRAD_NORM_RTOL = 1e-3
