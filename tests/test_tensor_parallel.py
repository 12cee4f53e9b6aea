"""Tensor parallelism: the plan for our GPT (model/tensor_parallel.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT, free_port

from model.tensor_parallel import head_group_order, natural_order, split_problem

# ---- the plan, in process ----------------------------------------------------------------------------------


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_each_ranks_rows_of_c_attn_are_q_k_and_v_of_its_own_heads(degree):
    C, n_head = 16, 4
    rows = head_group_order(C, degree)
    assert sorted(rows.tolist()) == list(range(3 * C))  # a permutation of the rows
    head_dim, share = C // n_head, C // degree
    for rank, part in enumerate(rows.split(3 * share)):  # what column-wise sharding gives rank `rank`
        q, k, v = part.split(share)
        heads = range(rank * n_head // degree, (rank + 1) * n_head // degree)
        expected = torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])
        assert torch.equal(q, expected) and torch.equal(k, expected + C) and torch.equal(v, expected + 2 * C)


def test_natural_order_undoes_the_head_group_order_and_leaves_the_rest_alone():
    C, degree = 8, 2
    weight, bias, other = torch.randn(3 * C, C), torch.randn(3 * C), torch.randn(C, C)
    order = head_group_order(C, degree)
    state = {"transformer.h.0.attn.c_attn.weight": weight[order], "transformer.h.0.attn.c_attn.bias": bias[order],
             "transformer.h.0.attn.c_proj.weight": other}
    back = natural_order(state, C, degree)
    assert torch.equal(back["transformer.h.0.attn.c_attn.weight"], weight)
    assert torch.equal(back["transformer.h.0.attn.c_attn.bias"], bias)
    assert back["transformer.h.0.attn.c_proj.weight"] is other
    assert natural_order(state, C, 1) is state


def test_split_problem_names_what_does_not_divide():
    assert split_problem(12, 768, 4) is None and split_problem(25, 1600, 5) is None
    assert "n_head 12 is not divisible by 5" in split_problem(12, 768, 5)
    assert "n_head 25 is not divisible by 2" in split_problem(25, 1600, 2)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_split_model_computes_what_the_whole_one_does(tmp_path):
    """The model alone on 2 processes: the split GPT's loss, gradients (gathered, in the Hugging Face order) and
    weights against the whole GPT's on every rank; each rank holds half of each split matrix."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO_ROOT / "tests" / "fixtures" / "tp" / "model_ranks.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        whole, split = report["losses"]
        assert split == pytest.approx(whole, rel=1e-6)
        assert report["grad_gap"] < 1e-6 and report["weight_gap"] == 0.0
        shapes = report["local_shapes"]  # C 32, 4 heads: 2 per rank
        assert shapes["transformer.h.0.attn.c_attn.weight"] == [48, 32]
        assert shapes["transformer.h.0.attn.c_proj.weight"] == [32, 16]
        assert shapes["transformer.h.0.mlp.c_fc.weight"] == [64, 32]
        assert shapes["transformer.h.0.mlp.c_proj.weight"] == [32, 64]
