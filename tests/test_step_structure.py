"""The GPU step's structure, held on the CPU (issue 59): what no CPU timing shows and a GPU window should not be the
first to find.

- Muon's launches: the ops one step dispatches at GPT-2 124M's 48 block-matrix shapes, counted on the meta device
  (no memory, no arithmetic). Stacking is the default, and the count is held at what it measured.
- What the loss keeps for backward, as inductor partitions the compiled step (its decompositions, the min-cut
  partitioner): the full-logits path one (tokens x vocabulary) tensor in bf16, the walk none of that size.
- Graph breaks: the accelerate-prepared bf16 model compiles to one graph on both loss paths. The host-sync counter
  (benchmarks/step_probe.py) cannot see inside compiled code, so "no sync" holds for a compiled step only with this.

The compiles here record the graphs AOT autograd hands the compiler, without inductor's code generation (which
starts compile workers and takes ~40 s on a small CPU): the partition is inductor's own.
"""
from __future__ import annotations

import functools

import pytest
import torch
from conftest import fresh_accelerate_state
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense
from torch.utils._python_dispatch import TorchDispatchMode

from model import GPT, GPTConfig
from training.optimizers.muon_optimizer import Muon

# GPT-2 124M's block matrices: c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj, 12 layers.
GPT2_BLOCK_SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12
# Measured 2026-11-28 (torch 2.13, meta device, the second step, weight decay 0 as in the presets): torch.optim.Muon
# 1,104 ops (15 Newton-Schulz ops per matrix and 8 more); ours stacked 97 (issue 53's stacking: 141; one foreach add
# per shape instead of 48 adds, no multiply by 1: 97). A change that adds ops must say why and move this.
MUON_LAUNCHES = 97
NOT_LAUNCHES = ("_record_function_enter_new", "_record_function_exit")  # the profiler's markers


def fused_on_cuda(args) -> bool:
    """Whether CUDA runs a foreach op as one fused kernel: its tensors share a dtype and device, are dense, and the
    lists match each other's sizes and strides index by index. Otherwise it runs tensor by tensor."""
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    first = lists[0][0]
    for tensors in lists:
        if any(t.dtype != first.dtype or t.device != first.device or not is_non_overlapping_and_dense(t)
               for t in tensors):
            return False
    return all(a.shape == b.shape and a.stride() == b.stride() for tensors in lists[1:] for a, b in
               zip(lists[0], tensors))


class LaunchCounter(TorchDispatchMode):
    """The ops that launch device work: views and the profiler's markers left out; a foreach op counts once where
    CUDA fuses it (`fused_on_cuda`), else once per tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NOT_LAUNCHES:
            self.count += 1 if not name.startswith("_foreach_") or fused_on_cuda(args) else len(args[0])
        return func(*args, **(kwargs or {}))


def muon_launches(optimizer_class, **kwargs) -> int:
    """The ops of Muon's second step (the first makes the momentum buffers) at GPT-2 124M's block shapes."""
    with torch.device("meta"):
        params = [torch.nn.Parameter(torch.empty(shape)) for shape in GPT2_BLOCK_SHAPES]
    for p in params:
        p.grad = torch.empty_like(p)
    optimizer = optimizer_class(params, lr=0.02, momentum=0.95, weight_decay=0.0, **kwargs)
    optimizer.step()
    counter = LaunchCounter()
    with counter:
        optimizer.step()
    return counter.count


def test_muons_step_launches_at_most_what_was_measured_at_gpt2s_shapes():
    """Our Muon's step (stacked by shape, the default) dispatches at most MUON_LAUNCHES ops at GPT-2 124M's 48 block
    matrices, where torch.optim.Muon dispatches over a thousand: one per op per matrix.

    Seen to catch: the 48 per-matrix `p.add_` back in place of the foreach add (141 ops); the updates left in bf16, so
    that CUDA would run the foreach tensor by tensor (139); `Muon.stacked = False` as the default."""
    assert Muon.stacked is True  # the default every run takes
    reference = muon_launches(torch.optim.Muon)
    assert reference == 1104  # the counter sees each matrix's work
    ours = muon_launches(Muon, ns_dtype=torch.bfloat16)
    assert ours <= MUON_LAUNCHES, f"{ours} ops, measured {MUON_LAUNCHES}"


# ---- the compiled step: one graph, and what it keeps for backward ------------------------------------------------

# Small, with GPT-2's proportions that decide the partitioner's cut: tokens >> n_embd, vocabulary >> n_embd, and
# the walk's chunks many (8 here; 32 at 16 x 1024 in 512 rows). With fewer tokens per chunk than that (2 chunks of
# 16 rows), min-cut keeps every chunk's bf16 logits gradient instead: as many bytes as the full logits.
CONFIG = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32, vocab_size=1000, dropout=0.0)
BATCH, WALK_ROWS = 8, 32
TOKENS, VOCAB = BATCH * CONFIG.block_size, 1024  # the vocabulary padded to a multiple of 64


def compile_step(rows: int) -> dict:
    """One forward and backward of `Accelerator(cpu=True, mixed_precision="bf16").prepare(GPT)` on the loss path
    `rows` (0: the full logits, WALK_ROWS: the walk), compiled through AOT autograd with inductor's decompositions and
    partitioner: the number of forward graphs, dynamo's graph breaks, and the shapes and dtypes of what the forward
    saves for the backward."""
    from accelerate import Accelerator
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    forwards = []

    def forward_compiler(graph, example_inputs):
        output = next(n for n in graph.graph.nodes if n.op == "output")
        forwards.append([a.meta["val"] for a in output.args[0][1:] if isinstance(a, torch.fx.Node)])
        return make_boxed_func(graph.forward)

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda graph, _: make_boxed_func(graph.forward),
                           partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
    torch._dynamo.reset()
    counters.clear()
    fresh_accelerate_state()
    try:
        torch.manual_seed(0)
        model = GPT(CONFIG)
        model.loss_chunk_rows = rows
        prepared = Accelerator(cpu=True, mixed_precision="bf16").prepare(model)
        x, y = (torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size)) for _ in range(2))
        _, loss = torch.compile(prepared, backend=backend)(x, y)
        loss.backward()
        return {"graphs": len(forwards), "breaks": sum(counters["graph_break"].values()),
                "saved": [(tuple(t.shape), t.dtype) for t in forwards[0]]}
    finally:
        torch._dynamo.reset()
        fresh_accelerate_state()


@pytest.fixture(scope="module")
def compiled_step():
    """`compile_step`, once per path in this file (a few seconds each), whichever test asks first; module-scoped so
    that xdist runs this file's tests on one worker (tests/conftest.py)."""
    return functools.cache(compile_step)


@pytest.mark.parametrize("rows", [0, WALK_ROWS], ids=["full logits", "walk"])
def test_the_prepared_bf16_model_compiles_to_one_graph(compiled_step, rows):
    """accelerate's bf16 wrapper (autocast, outputs cast to fp32) and either loss path trace as one graph, 0 breaks.

    Seen to catch: a `.item()` in the walk's forward (4 graphs, 7 breaks on that path)."""
    step = compiled_step(rows)
    assert (step["graphs"], step["breaks"]) == (1, 0)


def test_the_full_logits_keep_one_bf16_logits_tensor_for_backward_and_the_walk_none(compiled_step):
    """Full logits: the forward saves the (tokens x vocabulary) logits once, in bf16; inductor recomputes the fp32
    upcast and the softmax in the backward (without its decompositions, `aot_eager`, the fp32 log-softmax is saved:
    twice the bytes). The walk: nothing of that size; the tensors with a vocabulary dimension it saves are its fp32
    weight gradient, computed in the forward (GPT-2: 154 MB, against 6.6 GB of bf16 logits at 64 x 1024).

    Seen to catch: the full path's logits computed in fp32 (autocast off around `F.linear`: fp32 logits saved); the
    walk replaced by the full logits (a tokens x vocabulary tensor saved)."""
    logits = [(shape, dtype) for shape, dtype in compiled_step(0)["saved"] if shape == (TOKENS, VOCAB)]
    assert logits == [((TOKENS, VOCAB), torch.bfloat16)]
    assert all(torch.Size(shape).numel() < TOKENS * VOCAB for shape, _ in compiled_step(0)["saved"]
               if shape != (TOKENS, VOCAB))
    walk = compiled_step(WALK_ROWS)["saved"]
    assert max(torch.Size(shape).numel() for shape, _ in walk) < TOKENS * VOCAB
    assert [(shape, dtype) for shape, dtype in walk if VOCAB in shape] == [((VOCAB, CONFIG.n_embd), torch.float32)]
