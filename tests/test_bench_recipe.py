"""benchmarks/bench_recipe.py, the scan behind the default run's recipe (docs/benchmarks.md): every recipe it names
still parses as train.py's flags, its `before` is the recipe issue 55 replaced, and its compute is counted as the
docstring says. The runs themselves are minutes each: the benchmark, not a test, measures them.

Seen to catch: a recipe's `--muon_momentum` misspelt `--muon_mom`: unknown argument, did you mean `--muon_momentum`."""
from __future__ import annotations

import shlex

import pytest
import torch
from conftest import REPO_ROOT  # noqa: F401  (the repo root on sys.path)

from benchmarks.bench_recipe import RECIPES, compute
from configs import parse_config
from model import GPT, GPTConfig


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipe_is_flags_train_py_accepts(name):
    parse_config(shlex.split(RECIPES[name]))  # a renamed flag or a bad value raises UserError


def test_before_is_the_recipe_issue_55_replaced():
    cfg = parse_config(shlex.split(RECIPES["before"]))
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (4, 4, 128)
    assert (cfg.training.total_batch_size, cfg.training.micro_batch_size, cfg.training.max_steps) == (2048, 8, 100)
    assert (cfg.optim.lr, cfg.optim.beta2, cfg.optim.warmup_steps) == (1e-2, 0.95, 10)
    assert cfg.added["muon"].muon_momentum == 0.95


def test_compute_counts_the_steps_tokens_and_the_evaluations_forward():
    config = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 64, "max_steps": 10, "total_batch_size": 512,
              "val_tokens": 1024}
    with torch.device("meta"):
        fpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64)).flops_per_token()
    counted = compute(config, n_evals=3)
    assert counted["train_flops"] == 10 * 512 * fpt
    assert counted["eval_flops"] == pytest.approx(3 * 1024 * fpt / 3)  # a forward pass: a third of a step's FLOPs
    assert counted["flops"] == counted["train_flops"] + counted["eval_flops"]
