"""A new optimizer or in-training evaluation is one module and one registration line (docs/architecture.md, "What a
new piece touches"): a toy of each, registered here and nowhere else, runs through a whole train.py run, its
checkpoint, the model card, the run's last line, the support table and the memory planner; the count of product files
a new evaluation touches is computed from the code; and every evaluation flag belongs to one registered evaluation.

Seen to catch: the model card's results keys fixed as before the registry (`val_loss`, `hellaswag_*` only): the
whole-run test fails on the card's row. The planner's state hard-coded at Muon's 4 bytes per claimed parameter: the
planner test fails."""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, TINY, project_files, train_in_process

from common.engine_names import FSDP, Refusal
from common.errors import UserError
from common.parallelism import Parallelism
from common.resume_rules import ACCEPTED, RESTORED, SCHEDULE, flag
from configs import EvalConfig, parse_config
from configs.schema import all_groups
from model import GPT, GPTConfig
from planner import Launch, ParamCounts, RunPhases, plan_memory, plan_run
from training.distributed.layout import Layout
from training.distributed.support import support_table
from training.evaluations import hellaswag
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


@dataclass
class WeightNormFlags:
    """The toy evaluation's own flag: how often it scores, declared here alone."""

    _argument_group_name = "weight norm (a test's toy)"

    weight_norm_every: int = flag(0, "the weights' L2 norm every N steps; 0 = never", ACCEPTED)

    def __post_init__(self) -> None:
        if self.weight_norm_every < 0:
            raise UserError(f"--weight_norm_every must be 0 or more, got {self.weight_norm_every}; pass 0 to turn "
                            "it off")


def _weight_norm(plain, data, ctx, bf16):
    with torch.no_grad():
        return {"weight_norm": torch.sqrt(sum(p.float().pow(2).sum() for p in plain.parameters())).item()}, None


# The toy evaluation: the weights' L2 norm on its own schedule, drawn in a panel of its own, with the card's words on
# it and a command for the run's last line.
TOY_EVAL = EvaluationSpec(
    name="weight_norm", display="weight norm", flags=WeightNormFlags, every=lambda own: own.weight_norm_every,
    metrics=(Metric("weight_norm", "weight norm", "weights", "L2 norm", "norm"),),
    load=lambda ctx: None, score=_weight_norm, planned=lambda batch, block: (1, 1, "no forward"),
    card_note="the weight norm is the L2 norm of all parameters together",
    next_command=lambda run, own: f"python -m toy.weight_norm --model {run}",
)


@pytest.fixture
def toys():
    """The toys registered for one test through the registries' own `register` (the registration line), and
    taken out after it."""
    optimizers.register(TOY_OPTIMIZER)
    evaluations.register(TOY_EVAL)
    yield
    optimizers.unregister(TOY_OPTIMIZER.name)
    evaluations.unregister(TOY_EVAL.name)


@pytest.mark.parametrize("claims", [BLOCK_MATRICES, EVERY_PARAMETER])
def test_a_toy_optimizer_brings_its_own_flags_and_trains_what_it_claims(claims):
    """Registered with its flag group and nothing else: train.py parses `--rmsprop_lr` and `--rmsprop_alpha`, the
    plan carries them into the build and the schedule, a resume knows their rules, a bad value is its own one line.
    On the blocks' matrices it trains beside AdamW; claiming every parameter it trains alone.

    Each parameter is in one optimizer; unregistered, its flags are unknown again.

    Seen to catch: the plan built without the parsed flags (`flags.get` ignored): the toy's lr is 0.05, not 0.1."""
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
    """Both toys, registered and nowhere else named, go through a whole run: the toy optimizer's flag reaches the
    header and config.yaml and its state the checkpoint; the toy evaluation's flag sets its schedule, its metric
    reaches metrics.jsonl, the card's results, its note and its panel, and the run's last line has its score and
    its command.

    Seen to catch: the card rendered without the evaluations' notes (`notes=[]`): the toy's sentence is missing."""
    out = tmp_path / "run"
    stdout, _ = train_in_process(TINY + ["--optimizer", "rmsprop", "--rmsprop_lr", "0.04", "--max_steps", "4",
                                         "--eval_every", "4", "--weight_norm_every", "2",
                                         "--save_every", "2", "--micro_batch_size", "2", "--total_batch_size", "64",
                                         "--out_dir", str(out)])
    assert "optimizer: RMSprop (lr 0.04) on the blocks' 2-D weights" in stdout
    config = (out / "config.yaml").read_text()
    assert "rmsprop_lr: 0.04" in config and "weight_norm_every: 2" in config
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "weight_norm" in r] == [2, 4]
    assert [r["step"] for r in rows if "val_loss" in r] == [4]
    state = json.loads((out / "checkpoints" / "step_000004" / "run_state.json").read_text())
    assert state["optimizers"] == ["adamw", "rmsprop"]
    assert (out / "checkpoints" / "step_000004" / "optimizer_1.bin").is_file()  # the toy's momentum, saved
    card = (out / "final" / "README.md").read_text()
    assert "| weight norm |" in card and "weights" in card  # its result row, and its panel in loss_curve.png
    assert "Losses are mean next-token cross-entropy in nats; the weight norm is the L2 norm of all parameters " \
        "together." in card
    norm = next(r["weight_norm"] for r in rows if r["step"] == 4)
    (last,) = [line for line in stdout.splitlines() if "next: python -m model.sample" in line]
    assert last.startswith(f"validation loss {rows[-1]['val_loss']:.4f}, weight norm {norm:.4f} at step 4; ")
    assert f", python -m toy.weight_norm --model {out}, python -m publish.hub" in last


def test_a_registered_toy_optimizer_is_in_the_table_and_the_planner(toys):
    assert "| `--optimizer rmsprop` | runs | refused |" in support_table()
    with pytest.raises(Exception, match="--optimizer rmsprop is not supported under FSDP2 \\(a toy\\)"):
        Launch(1, Layout(2, Parallelism(FSDP)), optimizer="rmsprop")
    config = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)
    counts = ParamCounts.of(config)
    state = {i.name: i.bytes for i in plan_memory(config, Launch(1, optimizer="rmsprop", dtype="fp32")).items}
    assert state["optimizer state"] == 12 * counts.block_matrices + 8 * (counts.total - counts.block_matrices)


def test_a_registered_toy_evaluation_brings_its_own_flag_and_is_a_phase_of_the_plan(toys):
    """Registered with its flag group and nothing else: train.py parses `--weight_norm_every`, a bad value is its own
    one line, a resume accepts a change, the plan has its phase when the flag turns it on, and the run's last line
    has its command.

    Seen to catch: `register` without its `add_group` line: `unknown argument(s) --weight_norm_every 3`."""
    cfg = parse_config(["--weight_norm_every", "3"])
    assert cfg.added["weight_norm"].weight_norm_every == 3 and cfg.flat()["weight_norm_every"] == 3
    with pytest.raises(UserError, match="--weight_norm_every must be 0 or more, got -1"):
        parse_config(["--weight_norm_every", "-1"])
    assert "weight_norm_every" in FlagRules.now().accepted
    config = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)
    assert RunPhases.of_flags(EvalConfig(eval_batch_size=4)).evaluations == ("validation",)  # 0: never, by default
    run = RunPhases.of_flags(cfg.eval, cfg.added)
    assert run.evaluations == ("validation", "weight_norm")
    assert list(plan_run(config, Launch(4, dtype="fp32", device="cpu"), run).phases) == \
        ["step", "validation", "weight_norm", "checkpoint save", "export"]
    from training.evaluations.runner import next_steps

    assert ", python -m toy.weight_norm --model out/x, " in next_steps(Path("out/x"), None, cfg.added)


def test_every_evaluation_flag_belongs_to_one_evaluation():
    """Each evaluation's own flags are its flag group, added by its registration; the shared evaluation group
    holds only the batch they all use (`--eval_batch_size`).

    Seen to catch: an evaluation flag (`eval_sample_seed`) added to `EvalConfig` instead of its module: fails naming
    it.

    Seen to catch: before the flags moved into the evaluations' modules, `sample_prompt` left out of validation's
    declared flags failed the older form of this test."""
    assert [f.name for f in fields(EvalConfig)] == ["eval_batch_size"]
    for spec in evaluations.EVALUATIONS.values():
        assert spec.flags is None or all_groups()[spec.name] is spec.flags, spec.name


# What a product file is, for the count below: the packages a run imports and train.py. Not the tests, the
# benchmarks (which measure given evaluations), nor eval/: a scorer with a command line of its own, which an
# evaluation may wrap (eval.hellaswag) or not.
PRODUCT = {"common", "configs", "data", "model", "training", "publish", "planner", "train.py"}


def _code_names(path: Path) -> set[str]:
    """The words a file's code uses: its identifiers, import paths and string literals, not its docstrings or its
    comments."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}  # docstrings
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            words.add(node.name)
        elif isinstance(node, (ast.arg, ast.keyword)) and node.arg:
            words.add(node.arg)
        elif isinstance(node, ast.alias):
            words |= {*node.name.split("."), node.asname}
        elif isinstance(node, ast.ImportFrom) and node.module:
            words |= set(node.module.split("."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            words |= set(re.findall(r"\w+", node.value))
    return words


def _product_files_naming(own: set[str]) -> set[str]:
    """The product .py files whose code uses any of the words `own`."""
    found = set()
    for path in project_files(suffix=".py"):
        relative = path.relative_to(REPO_ROOT)
        if relative.parts[0] in PRODUCT and own & _code_names(path):
            found.add(relative.as_posix())
    return found


def _files_naming(spec: EvaluationSpec) -> set[str]:
    """The product files whose code names the evaluation (its name, a flag of its own or a metrics key), and the
    card's template if its text does, in any case."""
    own = {spec.name, *(f.name for f in fields(spec.flags or object)), *(m.key for m in spec.metrics)}
    found = _product_files_naming(own)
    template = REPO_ROOT / "publish" / "card_template.md"
    if {word.lower() for word in own} & set(re.findall(r"\w+", template.read_text().lower())):
        found.add("publish/card_template.md")
    return found


def test_a_new_evaluation_costs_the_product_files_docs_architecture_states(toys):
    """What a new evaluation costs, counted from the code: the product files that name it. The toy's flags, metric,
    card words and command reach the run (the tests above) with no product file naming it: its cost is its module
    and its registration line. HellaSwag, the LAMBADA-like evaluation that ships, is named by exactly those two
    files. docs/architecture.md's row states the count.

    Seen to catch: `hellaswag_data` put back as a parameter of `export_final`: fails naming
    `training/checkpoints/export.py`. Before this count, the row said 3 and the true cost was 6 (`EvalConfig`, the
    card's template, `export.py`'s last line, train.py)."""
    assert _files_naming(TOY_EVAL) == set()
    toy_cost = 2  # its module (here, this test file) and its `register(...)` line in the registry
    assert _files_naming(hellaswag.SPEC) == {"training/evaluations/hellaswag.py", "training/evaluations/registry.py"}
    row = re.search(r"^\| evaluation \| (\d+) \|", (REPO_ROOT / "docs" / "architecture.md").read_text(), re.M)
    assert row and int(row.group(1)) == toy_cost == len(_files_naming(hellaswag.SPEC))


def test_a_new_optimizer_costs_the_product_files_docs_architecture_states():
    """What a new optimizer costs, counted from the code: the product files that name it (its name or a flag of its
    own). The toy's flags, build, LR, state bytes and refusal reach the run, the planner and the support table (the
    tests above) with no product file naming it. Its cost is its module and its registration line.
    docs/architecture.md's row states the count.

    Seen to catch: "rmsprop" added to training/optimizers/plan.py's code: fails naming that file."""
    own = {TOY_OPTIMIZER.name, *(f.name for f in fields(TOY_OPTIMIZER.flags))}
    assert _product_files_naming(own) == set()
    toy_cost = 2  # its module (here, this test file) and its `register(...)` line in the registry
    # The count can fail: Muon's name is in its modules and its registration (and where a run picks it by default).
    assert {"training/optimizers/muon.py", "training/optimizers/registry.py"} <= _product_files_naming({"muon"})
    row = re.search(r"^\| optimizer \| (\d+) \|", (REPO_ROOT / "docs" / "architecture.md").read_text(), re.M)
    assert row and int(row.group(1)) == toy_cost
