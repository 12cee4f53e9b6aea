"""A new degree is one `Degree` and one `register(...)` (common/parallelism.py; docs/architecture.md, "What a new
piece touches"): a toy, registered here and nowhere else, has its flag and its resume rule, is named in the run
header, has its column and row in the support table, is refused where it does not run, is planned by the memory
planner, and is recorded and moved by a resume as a checkpoint's files ask."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from common.engine_names import DDP, FSDP, Refusal
from common.errors import UserError
from common.parallelism import Degree, Parallelism, register, unregister
from configs import parse_config
from model import GPT, GPTConfig
from planner import Launch, Shards, exit_after_plan
from training.checkpoints.moving import checkpoint_move
from training.distributed.layout import Layout
from training.distributed.processes import BatchGeometry
from training.distributed.support import refusal, support_table
from training.metrics import run_header
from training.optimizers.plan import plan_optimizers
from training.recipe import FlagRules

# The toy: N processes on FSDP2 hold one copy of the model between them, and its checkpoint's files depend on N.
# It refuses --on_nan skip in its column (a cell it declares), as tensor parallelism refuses LoRA.
TOY = Degree(
    name="toy_parallel", words="toy parallel", short="TOY", groups="toy groups", engine=FSDP,
    needs=Refusal("a toy runs on FSDP2", "launch with accelerate_configs/fsdp_8gpu.yaml, or leave out --toy_parallel"),
    in_checkpoint=True, help="a test's toy: N processes hold one copy of the model between them; 1 = none",
    refuses={"--on_nan skip": Refusal("a toy's step", "use --on_nan stop")})


@pytest.fixture
def toy():
    """The toy registered for one test through the registry's own `register` (the registration line), and taken out
    after it."""
    register(TOY)
    yield TOY
    unregister(TOY.name)


def test_a_toy_degree_brings_its_flag_and_its_resume_rule(toy):
    """Seen to catch: `parallelism_group` built once at import (the toy's flag unknown), and `Degree.resume` always
    ACCEPTED (the toy, whose checkpoint depends on it, not checked by the checkpoint)."""
    cfg = parse_config(["--toy_parallel", "2", "--tensor_parallel", "1"])
    assert Parallelism.of_flags(cfg.parallelism, FSDP) == Parallelism(FSDP, toy_parallel=2)
    assert cfg.flat()["toy_parallel"] == 2  # config.yaml records it
    rules = FlagRules.now()
    assert "toy_parallel" in rules.checked_by_the_checkpoint and "pipeline_parallel" not in \
        rules.checked_by_the_checkpoint
    with pytest.raises(UserError, match="--toy_parallel must be positive, got 0"):
        parse_config(["--toy_parallel", "0"])


def test_an_unregistered_degree_is_an_unknown_flag_again():
    """Taken out, the toy is an unknown flag, and a checkpoint that records it is refused, not read as unsplit. Seen to
    catch: `Parallelism.of_record` dropping the degrees it does not know."""
    with pytest.raises(UserError, match="unknown argument"):
        parse_config(["--toy_parallel", "2"])
    with pytest.raises(UserError, match="saved with toy_parallel 2, which this version does not know"):
        Parallelism.of_record({"kind": "fsdp", "zero_stage": 0, "toy_parallel": 2})


def test_a_toy_degree_is_named_in_the_run_header(toy):
    """Seen to catch: `degree_words` spelling the built-in degrees by name (the header without the toy)."""
    from accelerate import Accelerator
    from conftest import fresh_accelerate_state

    parallelism = Parallelism(FSDP, toy_parallel=2)
    assert parallelism.name == "FSDP2 x toy parallel 2" and parallelism.model_parallel == 2
    cfg = parse_config([])
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=128))
    try:
        header = run_header(Accelerator(cpu=True), parallelism, model, model.num_params(False),
                            BatchGeometry(2, 16, 1, 4), plan_optimizers(cfg.optim, cfg.model, cfg.added), 1.0, None,
                            "data: a test")
    finally:
        fresh_accelerate_state()
    assert "1 data-parallel rank(s) x 4 accumulation" in header and "distributed: NO x toy parallel 2 |" in header


def test_a_toy_degree_has_its_column_and_row_in_the_support_table(toy):
    """Seen to catch: `degree_row` leaving out the other degrees' columns (the toy beside tensor parallelism ran), and
    `support()` leaving out a degree's own cells (--on_nan skip ran under the toy)."""
    lines = support_table().splitlines()
    assert lines[0].endswith("| FSDP2 x TP | DDP x PP | FSDP2 x TOY |")
    assert "| `--toy_parallel` | refused | runs | refused | refused | refused | refused | refused | runs |" in lines
    assert "| `--on_nan skip` | runs | runs | refused | refused | refused | runs | runs | refused |" in lines
    assert refusal("--on_nan skip", Parallelism(FSDP, toy_parallel=2)) == \
        "--on_nan skip is not supported with --toy_parallel 2 (a toy's step); use --on_nan stop"
    for layout, words in ((Layout(4, Parallelism(DDP, toy_parallel=2)), "--toy_parallel 2 is not supported under "
                           "DDP (a toy runs on FSDP2); launch with accelerate_configs/fsdp_8gpu.yaml"),
                          (Layout(4, Parallelism(FSDP, tensor_parallel=2, toy_parallel=2)),
                           "--tensor_parallel 2 is not supported with --toy_parallel 2 (tensor-parallel groups "
                           "inside toy groups are not built yet); choose one of --toy_parallel and "
                           "--tensor_parallel"),
                          (Layout(3, Parallelism(FSDP, toy_parallel=2)), "--toy_parallel 2 needs a multiple of 2 "
                           "processes, this launch has 3; launch 2 processes")):
        with pytest.raises(UserError) as err:
            layout.check()
        assert str(err.value).startswith(words)


def test_a_toy_degree_reaches_the_planner(toy, monkeypatch, capsys):
    """`train.py --plan --toy_parallel 2` under an FSDP2 launch of 8: the toy's groups read one batch each, FSDP2
    shards over the 4 data-parallel ranks, and the plan names the launch. Seen to catch: `Layout.describe` naming
    tensor parallelism alone (the plan said "FSDP2 x toy parallel 2", not over how many groups)."""
    layout = Layout(8, Parallelism(FSDP, toy_parallel=2))
    assert Launch(4, layout).shards == Shards(4, 4, 4) and layout.describe() == "FSDP2 over 4 x toy parallel 2"
    with pytest.raises(UserError, match="--toy_parallel 2 is not supported under DDP"):
        Launch(4, Layout(8, Parallelism(DDP, toy_parallel=2)))
    for name, value in {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "8", "RANK": "0"}.items():
        monkeypatch.setenv(name, value)  # what accelerate launch tells a rank of fsdp_8gpu.yaml
    with pytest.raises(SystemExit) as exit_info:
        exit_after_plan(parse_config(["--plan", "--toy_parallel", "2", "--total_batch_size", "1024"]))
    assert exit_info.value.code == 0
    assert "8 process(es), FSDP2 over 4 x toy parallel 2" in capsys.readouterr().out


@pytest.mark.parametrize("in_checkpoint", [True, False])
def test_a_toy_degree_reaches_the_resume_rules(toy, tmp_path, in_checkpoint):
    """A checkpoint records the toy's degree; a resume under another moves the checkpoint when its files depend on
    the degree (as tensor parallelism's do), and reads it as it is when they do not (as a pipeline's). Seen to
    catch: `checkpoint_layout` keeping every degree (the resume with in_checkpoint False moved)."""
    unregister(TOY.name)
    register(replace(TOY, in_checkpoint=in_checkpoint))
    saved = Parallelism(FSDP, toy_parallel=2)
    assert saved.as_record() == {"kind": "fsdp", "zero_stage": 0, "tensor_parallel": 1, "pipeline_parallel": 1,
                                 "toy_parallel": 2} and Parallelism.of_record(saved.as_record()) == saved
    point = SimpleNamespace(path=tmp_path / "step_000004", world_size=4, engine=saved.as_record())
    cfg = parse_config([])
    plan = plan_optimizers(cfg.optim, cfg.model, cfg.added)
    assert checkpoint_move(point, saved, 4, plan) is None  # the launch that saved it reads it itself
    move = checkpoint_move(point, Parallelism(FSDP), 4, plan)
    assert (move is not None) == in_checkpoint
    if move is not None:
        assert "saved under FSDP2 x toy parallel 2 on 4 process(es), this launch runs FSDP2 on 4" in \
            move.announcement(point.path)
    rules = FlagRules.now()
    assert ("toy_parallel" in rules.checked_by_the_checkpoint) == in_checkpoint and "toy_parallel" in rules.accepted


def test_the_toy_is_declared_in_this_file_alone():
    """The toy needs no product file: no project module outside tests/ names it. Seen to catch: a comment naming
    toy_parallel in common/resume_rules.py."""
    from conftest import REPO_ROOT, project_files

    named = [str(p.relative_to(REPO_ROOT)) for p in project_files(suffix=".py")
             if not str(p.relative_to(REPO_ROOT)).startswith("tests/") and "toy_parallel" in p.read_text()]
    assert named == []
