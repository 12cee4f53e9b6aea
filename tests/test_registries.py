"""A new optimizer or in-training evaluation is one module and one registration line (docs/architecture.md, "How a
new piece enters"): a toy of each, registered here and nowhere else, runs through a whole train.py run, its
checkpoint, the model card, the support table and the memory planner; and every evaluation flag belongs to one
registered evaluation."""
from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch
from conftest import TINY, train_in_process

from common.engine_names import Refusal
from configs import EvalConfig
from model import GPTConfig
from planner import Launch, ParamCounts, RunPhases, plan_memory, plan_run
from training.distributed.support import support_table
from training.evaluations import registry as evaluations
from training.evaluations.spec import EvaluationSpec, Metric
from training.optimizers import registry as optimizers
from training.optimizers.spec import BLOCK_MATRICES, OptimizerSpec

# The toy optimizer: centered RMSprop with momentum on the blocks' matrices, AdamW on the rest, refused under FSDP2.
TOY_OPTIMIZER = OptimizerSpec(
    name="rmsprop", display="RMSprop", claims=BLOCK_MATRICES, state_bytes=12,  # 3 fp32 buffers: not Muon's 4
    build=lambda params, plan, device_type: torch.optim.RMSprop(params, lr=0.05, momentum=0.9, centered=True),
    peak_lr=lambda plan: 0.05,
    refused_under={"FSDP2": Refusal("a toy", "use --optimizer adamw")},
)


def _weight_norm(plain, data, ctx, bf16):
    with torch.no_grad():
        return {"weight_norm": torch.sqrt(sum(p.float().pow(2).sum() for p in plain.parameters())).item()}, None


# The toy evaluation: the weights' L2 norm, on validation's schedule, drawn in a panel of its own.
TOY_EVAL = EvaluationSpec(
    name="weight_norm", display="weight norm", flags=(), every=lambda cfg: cfg.eval_every,
    metrics=(Metric("weight_norm", "weight norm", "weights", "L2 norm", "norm"),),
    load=lambda ctx: None, score=_weight_norm, planned=lambda batch, block: (1, 1, "no forward"),
)


@pytest.fixture
def toys():
    """The toys registered for one test through the registries' own `register` (the registration line), and
    taken out after it."""
    optimizers.register(TOY_OPTIMIZER)
    evaluations.register(TOY_EVAL)
    yield
    del optimizers.OPTIMIZERS[TOY_OPTIMIZER.name], evaluations.EVALUATIONS[TOY_EVAL.name]


@pytest.mark.slow
def test_a_registered_toy_optimizer_and_evaluation_run_through_a_whole_run(toys, tmp_path):
    out = tmp_path / "run"
    stdout, _ = train_in_process(TINY + ["--optimizer", "rmsprop", "--max_steps", "4", "--eval_every", "2",
                                         "--save_every", "2", "--micro_batch_size", "2", "--total_batch_size", "64",
                                         "--out_dir", str(out)])
    assert "optimizer: RMSprop (lr 0.05) on the blocks' 2-D weights" in stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "weight_norm" in r] == [2, 4]
    state = json.loads((out / "checkpoints" / "step_000004" / "run_state.json").read_text())
    assert state["optimizers"] == ["adamw", "rmsprop"]
    assert (out / "checkpoints" / "step_000004" / "optimizer_1.bin").is_file()  # the toy's momentum, saved
    card = (out / "final" / "README.md").read_text()
    assert "| weight norm |" in card and "weights" in card  # its result row, and its panel in loss_curve.png


def test_a_registered_toy_optimizer_is_in_the_table_and_the_planner(toys):
    assert "| `--optimizer rmsprop` | runs | refused |" in support_table()
    with pytest.raises(Exception, match="--optimizer rmsprop is not supported under FSDP2 \\(a toy\\)"):
        Launch(1, processes=2, fsdp=True, optimizer="rmsprop")
    config = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)
    counts = ParamCounts.of(config)
    state = {i.name: i.bytes for i in plan_memory(config, Launch(1, optimizer="rmsprop", dtype="fp32")).items}
    assert state["optimizer state"] == 12 * counts.block_matrices + 8 * (counts.total - counts.block_matrices)


def test_a_registered_toy_evaluation_is_a_phase_of_the_plan(toys):
    run = RunPhases.of_flags(EvalConfig(eval_batch_size=4))
    assert run.evaluations == ("validation", "weight_norm")
    config = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)
    assert list(plan_run(config, Launch(4, dtype="fp32", device="cpu"), run).phases) == \
        ["step", "validation", "weight_norm", "checkpoint save", "export"]


def test_every_evaluation_flag_belongs_to_one_evaluation():
    """Each flag of the evaluation group is read by exactly one registered evaluation, or is the batch they share."""
    declared = [flag for spec in evaluations.EVALUATIONS.values() for flag in spec.flags]
    assert sorted(declared) == sorted(f.name for f in fields(EvalConfig) if f.name != "eval_batch_size")
