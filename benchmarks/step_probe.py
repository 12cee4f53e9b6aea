"""What the GPU window's sweep measures inside train.py's step beyond its tokens/s (benchmarks/bench_train.py's
`--phases`, `--sync_count`, `--profile`; benchmarks/gpu_acceptance.py's `sweep` stage runs them):

- `Phases`: the optimizer step's and the gradient clip's time, by wrapping `optimizer.step` and
  `accelerator.clip_grad_norm_` on the instances train_step calls. On CUDA a pair of CUDA events around each call (no
  added sync: they are read after the trial's own synchronize), so the figure is the GPU time from the first kernel
  queued to the last one done, idle gaps of a launch-bound optimizer included; on a CPU `time.perf_counter`.
- `SyncCounter`: a `TorchDispatchMode` counting the ops that make the host wait for the device
  (`aten._local_scalar_dense`, behind `.item()`, `float()`, `int()`, `bool()`; `aten.equal`, `aten.is_nonzero`,
  `aten.nonzero`, `aten.masked_select`), by the phase they ran in (`optimizer` inside `optimizer.step`, `clip`, else
  `step`). The same count on a CPU and on CUDA, so a CPU test and a GPU row say the same thing. It does not see a
  pageable `non_blocking` copy's implicit wait, nor collectives; `torch.cuda.set_sync_debug_mode("warn")` (on CUDA,
  counted beside it by bench_train) sees the CUDA runtime's syncs but not those. Dynamo does not compile a frame
  under a dispatch mode (it runs it eagerly), so bench_train counts over one step after every timed one.
- `profile_table`: a torch.profiler run's self time by op, top 25, and totals by category (GEMM, attention, triton,
  elementwise, optimizer, memcpy, other): on CUDA the kernels' self device time (the profiler's user annotations left
  out, which would count their kernels twice), on a CPU the ops' self CPU time. Muon's Newton-Schulz matmuls are
  GEMMs there like any other; the optimizer's whole time is `Phases`' figure.
- `attention_kernel`: which of SDPA's kernels ran in a profiled step, read from every op and kernel name the profiler
  saw (`SDPA_KERNELS`): cuDNN's (`cudnn_generated_fort_native_sdpa_sm90*`), FlashAttention-2's (`flash_fwd*`), the
  memory-efficient one (`fmha_cutlass*`) or the math path; on a CPU the ATen op's name says it.
"""
from __future__ import annotations

import time
import warnings
from collections import Counter
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = ("_local_scalar_dense", "equal", "is_nonzero", "nonzero", "masked_select")
PROFILE_TOP = 25
# First match wins, on the lower-cased op or kernel name. GEMM before triton: inductor's matmul templates are
# `triton_tem_*`; attention before GEMM: flash attention's kernels are CUTLASS ones.
CATEGORIES = (
    ("optimizer", ("multi_tensor_apply", "adam", "muon", "_foreach", "optimizer.step", "newton")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "scaled_dot_product", "cudnn")),
    ("GEMM", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "triton_tem", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::baddbmm", "aten::matmul", "sm90_", "sm80_", "ampere_")),
    ("triton", ("triton",)),
    ("memcpy", ("memcpy", "memset", "copy", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce", "layer_norm", "softmax", "embedding",
                     "aten::add", "aten::sub", "aten::mul", "aten::div", "aten::exp", "aten::log", "aten::gelu",
                     "aten::tanh", "aten::pow", "aten::sqrt", "aten::rsqrt", "aten::neg", "aten::where",
                     "aten::fill", "aten::zero", "aten::sum", "aten::mean", "aten::max", "aten::lerp", "aten::clamp",
                     "aten::norm", "aten::linalg_vector_norm", "aten::gather", "aten::scatter", "aten::nll_loss",
                     "aten::index", "aten::masked_fill", "aten::lt", "aten::ne", "aten::eq")),
)
CATEGORY_NAMES = tuple(name for name, _ in CATEGORIES) + ("other",)
# SDPA's kernels by the words in their names (lower-cased), first match wins: cuDNN's Hopper kernels carry "flash"
# in their names too, so cuDNN comes first. A CUDA kernel's name on a GPU; on a CPU (and beside the kernels on a GPU)
# the ATen op's, e.g. `aten::_scaled_dot_product_flash_attention_for_cpu`. Compiled math attention is decomposed into
# matmuls and a softmax: no name says it, and the step reads "none seen".
SDPA_KERNELS = (
    ("cudnn", ("cudnn_generated_fort_native_sdpa", "_scaled_dot_product_cudnn_attention", "cudnn_sdpa")),
    ("flash", ("flash_fwd", "flash_bwd", "_scaled_dot_product_flash_attention", "pytorch_flash::")),
    ("efficient", ("fmha_cutlass", "_scaled_dot_product_efficient_attention", "_efficient_attention")),
    ("math", ("_scaled_dot_product_attention_math",)),
)


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, words in CATEGORIES if any(w in low for w in words)), "other")


def attention_kernel(names) -> str | None:
    """The SDPA kernel family the names show ("cudnn", "flash", "efficient", "math"; several joined by "+"), or None
    where none is seen."""
    found = set()
    for name in names:
        low = name.lower()
        family = next((fam for fam, words in SDPA_KERNELS if any(w in low for w in words)), None)
        if family:
            found.add(family)
    return "+".join(sorted(found)) or None


class SyncCounter(TorchDispatchMode):
    """Counts the host-sync ops dispatched while it is entered, by `section` (set by `Phases` around the optimizer
    step and the clip)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.section = "step"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.counts[(self.section, name)] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict:
        total = sum(self.counts.values())
        by_op = Counter()
        for (_, op), n in self.counts.items():
            by_op[op] += n
        return {"host_syncs": total, "host_syncs_in_optimizer": sum(n for (s, _), n in self.counts.items()
                                                                   if s == "optimizer"),
                "host_syncs_by_op": dict(by_op)}


class Phases:
    """Wraps callables of train.py's step (`wrap(obj, "step", "optimizer")`) to time them and to tell a
    `SyncCounter` which phase it is in."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.counter: SyncCounter | None = None
        self._marks: dict[str, list] = {}

    def wrap(self, obj: object, attr: str, phase: str) -> None:
        inner: Callable = getattr(obj, attr)
        self._marks.setdefault(phase, [])

        def timed(*args, **kwargs):
            if self.counter is not None:
                self.counter.section = phase
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.cuda:
                    end.record()
                else:
                    end = time.perf_counter()
                self._marks[phase].append((start, end))
                if self.counter is not None:
                    self.counter.section = "step"
        setattr(obj, attr, timed)

    def reset(self) -> None:
        for marks in self._marks.values():
            marks.clear()

    def total_ms(self) -> dict[str, float]:
        """Milliseconds per phase since `reset`, summed over its calls (synchronizes on CUDA first)."""
        if self.cuda:
            torch.cuda.synchronize()
            return {p: sum(s.elapsed_time(e) for s, e in marks) for p, marks in self._marks.items()}
        return {p: 1e3 * sum(e - s for s, e in marks) for p, marks in self._marks.items()}


def profile_table(prof: torch.profiler.profile, device_type: str, steps: int = 1) -> dict:
    """Self time per step by op (top `PROFILE_TOP`) and by category, in ms: the kernels' self device time on CUDA,
    the ops' self CPU time on a CPU."""
    cuda = device_type == "cuda"
    rows = []
    for e in prof.key_averages():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False):
                continue
            us = getattr(e, "self_device_time_total", None)
            us = e.self_cuda_time_total if us is None else us  # the name before torch 2.4
        else:
            if e.device_type != torch.autograd.DeviceType.CPU:
                continue
            us = e.self_cpu_time_total
        if us > 0:
            rows.append({"name": e.key, "category": category(e.key), "ms": us / 1e3 / steps,
                         "calls": e.count // steps})
    rows.sort(key=lambda r: -r["ms"])
    categories = {c: 0.0 for c in CATEGORY_NAMES}
    for r in rows:
        categories[r["category"]] += r["ms"]
    return {"time": "self device time (CUDA kernels)" if cuda else "self CPU time (ops)", "unit": "ms per step",
            "steps": steps, "total_ms": sum(categories.values()), "categories": categories,
            "top": rows[:PROFILE_TOP]}


def format_profile_table(table: dict, width: int = 72) -> str:
    """The table as text: the categories, then the top ops."""
    total = table["total_ms"] or 1.0
    lines = [f"{table['time']}, {table['unit']} ({table['steps']} step(s) profiled): total {table['total_ms']:.2f} ms",
             "  " + " | ".join(f"{c} {ms:.2f} ({ms / total:.0%})" for c, ms in table["categories"].items() if ms),
             f"  {'ms':>9} {'share':>6} {'calls':>6}  {'category':<11} op"]
    for r in table["top"]:
        name = r["name"] if len(r["name"]) <= width else r["name"][:width - 3] + "..."
        lines.append(f"  {r['ms']:>9.3f} {r['ms'] / total:>6.1%} {r['calls']:>6}  {r['category']:<11} {name}")
    return "\n".join(lines)


def profile_step(step: Callable[[], object], device: torch.device) -> dict:
    """`step()` once under torch.profiler: its `profile_table`, the SDPA kernel that ran (`attention_kernel`), and the
    table as text (for gpu_acceptance.py's report, which imports no torch)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    table = profile_table(prof, device.type)
    table["attention_kernel"] = attention_kernel(e.key for e in prof.key_averages())
    table["text"] = format_profile_table(table) + f"\n  attention: {table['attention_kernel'] or 'none seen'}"
    print("profile of one train.py step, " + table["text"])
    return table


def count_syncs(step: Callable[[], object], phases: Phases, device: torch.device) -> dict:
    """`step()` once under a `SyncCounter` (told the phase by `phases`) and, on CUDA,
    `torch.cuda.set_sync_debug_mode("warn")`, whose warnings are counted beside it."""
    counter = phases.counter = SyncCounter()
    cuda = device.type == "cuda"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with counter:
                step()
        finally:
            phases.counter = None
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    syncs = counter.summary()
    if cuda:
        syncs["cuda_sync_warnings"] = sum("synchroniz" in str(w.message) for w in caught)
    print(f"host syncs in one train.py step: {syncs}")
    return syncs


def probe(what: str, measure: Callable[[], dict]) -> dict:
    """`measure()`, or {"error": ...} where it raises: an extra step's failure is its own figure's."""
    try:
        return measure()
    except Exception as err:  # whatever it is, the timed figures stand
        print(f"{what}: failed ({type(err).__name__}: {err})")
        return {"error": f"{type(err).__name__}: {str(err)[:300]}"}
