"""A new optimizer or in-training evaluation is one module and one registration line (docs/architecture.md, "What a
new piece touches"): a toy of each, registered here and nowhere else, runs through a whole train.py run, its
checkpoint, the model card, the support table and the memory planner; and every evaluation flag belongs to one
registered evaluation."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace

import pytest
import torch
from conftest import TINY, train_in_process

from common.engine_names import FSDP, Refusal
from common.errors import UserError
from common.resume_rules import RESTORED, SCHEDULE, flag
from configs import EvalConfig, parse_config
from model import GPT, GPTConfig
from planner import Launch, ParamCounts, RunPhases, plan_memory, plan_run
from training.distributed.layout import Layout
from training.distributed.support import support_table
from training.evaluations import registry as evaluations
from training.evaluations.spec import EvaluationSpec, Metric
from training.optimizers import registry as optimizers
from training.optimizers.plan import build_optimizer, plan_optimizers
from training.optimizers.spec import BLOCK_MATRICES, EVERY_PARAMETER, OptimizerSpec
from training.recipe import FlagRules


@dataclass
class RMSpropFlags:
    """The toy's own flags: its learning rate and its beta (the squared gradients' average), declared here alone."""

    _argument_group_name = "RMSprop (a test's toy)"

    rmsprop_lr: float = flag(0.05, "the toy's peak learning rate", SCHEDULE)
    rmsprop_alpha: float = flag(0.99, "the toy's beta: the decay of its squared-gradient average", RESTORED)

    def __post_init__(self) -> None:
        if not 0 < self.rmsprop_alpha < 1:
            raise UserError(f"--rmsprop_alpha must be in (0, 1), got {self.rmsprop_alpha}; use e.g. 0.99")


def _build_rmsprop(params, plan, device_type):
    return torch.optim.RMSprop(params, lr=plan.flags.rmsprop_lr, alpha=plan.flags.rmsprop_alpha, momentum=0.9,
                               centered=True)


# The toy optimizer: centered RMSprop with momentum on the blocks' matrices, AdamW on the rest, refused under FSDP2.
TOY_OPTIMIZER = OptimizerSpec(
    name="rmsprop", display="RMSprop", claims=BLOCK_MATRICES, state_bytes=12,  # 3 fp32 buffers: not Muon's 4
    flags=RMSpropFlags, build=_build_rmsprop, peak_lr=lambda plan: plan.flags.rmsprop_lr,
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
    optimizers.unregister(TOY_OPTIMIZER.name)
    del evaluations.EVALUATIONS[TOY_EVAL.name]


@pytest.mark.parametrize("claims", [BLOCK_MATRICES, EVERY_PARAMETER])
def test_a_toy_optimizer_brings_its_own_flags_and_trains_what_it_claims(claims):
    """Registered with its flag group and nothing else: train.py parses `--rmsprop_lr` and `--rmsprop_alpha`, the
    plan carries them into the build and the schedule, a resume knows their rules, a bad value is its own one line.
    On the blocks' matrices it trains beside AdamW; claiming every parameter it trains alone."""
    optimizers.register(replace(TOY_OPTIMIZER, claims=claims))
    try:
        cfg = parse_config(["--optimizer", "rmsprop", "--rmsprop_lr", "0.1", "--rmsprop_alpha", "0.9", "--lr", "1e-3"])
        plan = plan_optimizers(cfg.optim, cfg.model, cfg.added)
        alone = claims == EVERY_PARAMETER
        assert plan.names == (("rmsprop",) if alone else ("adamw", "rmsprop"))
        assert plan.lrs_at(0.5) == ([0.05] if alone else [5e-4, 0.05])
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=16, vocab_size=128))
        built = build_optimizer(model, plan, "cpu")
        toy = built[-1]
        assert isinstance(toy, torch.optim.RMSprop) and toy.defaults["alpha"] == 0.9 and toy.defaults["lr"] == 0.1
        trained = sum(p.numel() for group in toy.param_groups for p in group["params"])
        assert trained == (model.num_params(False) if alone else ParamCounts.of(model.config).block_matrices)
        assert sum(p.numel() for opt in built for group in opt.param_groups for p in group["params"]) == \
            model.num_params(False)  # every parameter in exactly one optimizer
        rules = FlagRules.now()
        assert "rmsprop_lr" in rules.schedule and "rmsprop_alpha" in rules.refused
        with pytest.raises(UserError, match="--rmsprop_alpha must be in \\(0, 1\\)"):
            parse_config(["--optimizer", "rmsprop", "--rmsprop_alpha", "1.5"])
    finally:
        optimizers.unregister("rmsprop")
    with pytest.raises(UserError, match="unknown argument"):  # gone with it: an unknown flag again
        parse_config(["--rmsprop_lr", "0.1"])


@pytest.mark.slow
def test_a_registered_toy_optimizer_and_evaluation_run_through_a_whole_run(toys, tmp_path):
    out = tmp_path / "run"
    stdout, _ = train_in_process(TINY + ["--optimizer", "rmsprop", "--rmsprop_lr", "0.04", "--max_steps", "4",
                                         "--eval_every", "2",
                                         "--save_every", "2", "--micro_batch_size", "2", "--total_batch_size", "64",
                                         "--out_dir", str(out)])
    assert "optimizer: RMSprop (lr 0.04) on the blocks' 2-D weights" in stdout
    assert "rmsprop_lr: 0.04" in (out / "config.yaml").read_text()
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
        Launch(1, Layout(2, FSDP), optimizer="rmsprop")
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
