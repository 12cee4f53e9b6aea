"""--pipeline_parallel N: whole blocks on different processes (model/pipeline.py, training/distributed/pipeline.py).

References: one process accumulating the same micro-batches (`single_run`, DDP_ARGS) for the 2-stage and the
2 stages x 2 pipelines runs (to float rounding, tests/bounds.py: the stages sum the same gradients in another
order); the pipeline's own uninterrupted run for its resumes (bit for bit); the whole GPT's forward for the stages
chained in one process."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import (
    DDP_ARGS,
    assert_same_metrics,
    assert_same_weights,
    assert_weights_within_rounding,
    launch,
    read_metrics,
    resume_copy,
    run_in_process,
    shared_once,
)

from common.engine_names import FSDP
from common.errors import UserError
from common.parallelism import Parallelism
from model import GPT, GPTConfig
from model.pipeline import GPTStage, stage_blocks
from training.distributed.layout import Layout
from training.distributed.pipeline import pipelined

PP_ARGS = DDP_ARGS + ["--pipeline_parallel", "2"]


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory):
    """DDP_ARGS as 2 stages on 2 processes (one pipeline, 4 micro-batches a step), each rank's parameters probed."""
    def build(folder):
        (folder / "probe").mkdir()
        proc = launch(PP_ARGS + ["--out_dir", str(folder / "run")], nproc=2,
                      extra_env={"PIPELINE_PROBE": str(folder / "probe")})
        (folder / "output.txt").write_text(proc.stdout + proc.stderr)  # what it printed, for the tests to read
    return shared_once(tmp_path_factory, "pipeline", build)


# ---- the stages, in one process --------------------------------------------------------------------------------

def test_stages_take_consecutive_blocks_the_earlier_ones_more():
    """The stages take consecutive blocks, as even as they divide, the earlier ones one more.

    Seen to catch: the remainder given to the last stage: fails."""
    assert stage_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_blocks(4, 4) == [range(i, i + 1) for i in range(4)]
    assert [b for r in stage_blocks(12, 5) for b in r] == list(range(12))
    with pytest.raises(ValueError):
        stage_blocks(2, 3)


def test_chained_stages_compute_the_whole_models_loss_and_hold_only_their_parts():
    """The stages chained in one process compute the whole GPT's loss (1e-6 relative) and hold the whole model's
    parameters between them under its names, only the tied embedding on two.

    Seen to catch: not broken on purpose: new with the stages, it passed the first time."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=100, n_layer=3, n_head=2, n_embd=32, block_size=16, dropout=0.0)
    whole = GPT(config).eval()
    x, y = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        _, expected = whole(x, y)
    names = {name for name, _ in whole.named_parameters()}
    stages = [GPTStage(GPT(config), s, 2) for s in range(2)]
    for stage in stages:  # the same initial weights: each stage cut from a model built with the same seed
        stage.load_state_dict({k: v for k, v in whole.state_dict().items() if k in stage.state_dict()})
        stage.eval()
    first, last = ({name for name, _ in stage.named_parameters()} for stage in stages)
    assert first | last == names and first & last == {"transformer.wte.weight"}  # the tied weight's copy
    assert {n.split(".")[2] for n in first if n.startswith("transformer.h.")} == {"0", "1"}
    assert {n.split(".")[2] for n in last if n.startswith("transformer.h.")} == {"2"}
    with torch.no_grad():
        loss = stages[1].loss(stages[1](stages[0](x)), y)
    assert torch.allclose(loss, expected, rtol=1e-6, atol=0)


def test_activation_checkpointing_inside_a_stage_gives_the_same_gradients():
    """Activation checkpointing inside a stage gives the gradients of the plain stages (1e-5 relative).

    Seen to catch: not broken on purpose: it passed the first time. A whole 2-stage run with
    `--activation_checkpointing` was checked by hand: the same validation losses as without."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=100, n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.0)
    state = GPT(config).state_dict()
    x, y = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    grads = []
    for recompute in (False, True):
        whole = GPT(config)
        whole.load_state_dict(state)
        stages = [GPTStage(whole, 0, 2)]
        stages.append(GPTStage(whole, 1, 2))
        for stage in stages:
            stage.activation_checkpointing = recompute
        stages[1].loss(stages[1](stages[0](x)), y).backward()
        grads.append({n: p.grad.clone() for stage in stages for n, p in stage.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7), name


def test_fewer_micro_batches_than_stages_is_one_line():
    model = GPT(GPTConfig(vocab_size=100, n_layer=2, n_head=2, n_embd=32, block_size=16))
    with pytest.raises(UserError, match=r"--pipeline_parallel 2 needs at least 2 micro-batches per step, this run "
                                        r"has 1; raise --total_batch_size or lower --micro_batch_size"):
        pipelined(model, Layout(2, Parallelism(pipeline_parallel=2)), micro_batches=1, micro_batch_size=2,
                  accelerator=None)


@pytest.mark.parametrize("flags, message", [
    (["--pipeline_parallel", "2"], "--pipeline_parallel 2 needs a multiple of 2 processes, this "
                                   "launch has 1; launch 2 processes"),
    (["--pipeline_parallel", "3"], "--pipeline_parallel 3 needs a multiple of 3 processes"),
])
def test_a_pipeline_this_launch_cannot_run_is_one_line(monkeypatch, capsys, tmp_path, flags, message):
    """Refusals, one line each: a launch that is not a multiple of the stages, more stages than blocks
    (`test_more_stages_than_blocks_is_one_line`), fewer micro-batches than stages
    (`test_fewer_micro_batches_than_stages_is_one_line`), under FSDP2 or ZeRO, with TP or LoRA. The planner refuses the
    same (`test_the_planner_refuses_a_pipeline_as_the_run_does`; `test_support.py`, the `DDP x PP` column).

    Seen to catch: not broken on purpose (new with the refusals)."""
    err = run_in_process(monkeypatch, capsys, DDP_ARGS + flags + ["--out_dir", str(tmp_path / "run")])
    assert message in err
    assert not (tmp_path / "run").exists()


def test_more_stages_than_blocks_is_one_line():
    with pytest.raises(UserError, match="--pipeline_parallel 4 needs at least one block per stage, the model has 2; "
                                        "pass at most 2"):
        Layout(4, Parallelism(pipeline_parallel=4)).check_model(2, 32, 2)


# ---- whole runs ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_stages_train_as_one_process(pipeline_run, single_run):
    """2 stages on 2 processes, and 2 pipelines x 2 stages on 4
    (`test_two_pipelines_of_two_stages_train_as_one_process`), train as one process: final weights to float rounding,
    every step's loss and validation loss and the gradient norm (`assert_same_metrics`); `final/` is the whole model
    gathered from the stages. Measured for 2 stages: losses equal to the bit, the gradient norm 5.9e-6 to 6.0e-5
    relative over the 4 steps, growing as ZeRO's does, under the 1e-3 bound.

    Seen to catch: the tied embedding's gradients not summed across the first and last stage: 28 tensors beyond
    rounding. The tied weight's gradient counted twice in the norm: 28 tensors (clipping then scales every step
    otherwise)."""
    run = pipeline_run / "run"
    assert_weights_within_rounding(run, single_run)  # final/: the whole model, gathered from the stages
    assert_same_metrics(run, single_run)
    assert [m["val_loss"] for m in read_metrics(run) if "val_loss" in m] == \
        pytest.approx([m["val_loss"] for m in read_metrics(single_run) if "val_loss" in m], rel=1e-6)


@pytest.mark.slow
def test_each_rank_holds_only_its_stage(pipeline_run):
    """Each rank holds only its stage (`PIPELINE_PROBE` in tests/fault_train.py): its blocks, the embeddings on the
    first, `ln_f` and the output layer's copy on the last, nothing twice but that copy. The header's optimizer line says
    it counts rank 0's stage (`optimizer (this stage's, blocks 0-0 of 2; each stage steps its own): ...`), with that
    stage's parameters as the probe counts them.

    Seen to catch: `stage=None` in `run_header`: the line reads `optimizer: AdamW ... 1.62M` again. The probe part
    passed the first time."""
    held = {int(p.stem[4:]): json.loads(p.read_text()) for p in (pipeline_run / "probe").glob("rank*.json")}
    assert sorted(held) == [0, 1] and [held[r]["stage"] for r in (0, 1)] == [0, 1]
    blocks = [{n.split(".")[2] for n in held[r]["params"] if n.startswith("transformer.h.")} for r in (0, 1)]
    assert blocks == [{"0"}, {"1"}]  # TINY's 2 blocks, one per stage
    assert "transformer.wpe.weight" in held[0]["params"] and "transformer.wpe.weight" not in held[1]["params"]
    assert "transformer.ln_f.weight" in held[1]["params"] and "transformer.ln_f.weight" not in held[0]["params"]
    whole = sum(p.numel() for p in GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)).parameters())
    tied = 50304 * 32  # the output layer's copy of the token embedding, on the last stage
    assert sum(held[0]["params"].values()) + sum(held[1]["params"].values()) == whole + tied
    # The header's optimizer line counts rank 0's stage, and says so (issue 55: it counted one stage unsaid).
    assert f"optimizer (this stage's, blocks 0-0 of 2; each stage steps its own): AdamW (lr 0.001) on all " \
           f"{sum(held[0]['params'].values()) / 1e6:.2f}M trainable params" in (pipeline_run / "output.txt").read_text()


@pytest.mark.slow
def test_two_pipelines_of_two_stages_train_as_one_process(tmp_path, single_run):
    launch(PP_ARGS + ["--out_dir", str(tmp_path / "run")], nproc=4)  # 2 data-parallel x 2 stages
    assert_weights_within_rounding(tmp_path / "run", single_run)
    assert_same_metrics(tmp_path / "run", single_run)


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_bit_exact(pipeline_run, tmp_path):
    """A pipeline checkpoint resumes bit for bit (a copy resumed at step 2; and killed by SIGKILL after step 3, then
    `--resume latest`: `test_a_pipeline_killed_then_resumed_ends_bit_exact`), each step logged once. Its files are a DDP
    run's, written and read by `checkpoint_io/ddp_files.py`.

    Seen to catch: the gathered optimizer state numbered in another order: the resume stops with docs/faults.md's one
    line (before the shape check: a traceback at the next step). Moving the format to `ddp_files`, the gathered settings
    passed where the numbering goes: every pipeline save failed with a TypeError."""
    launch(PP_ARGS + resume_copy(pipeline_run / "run", 2, tmp_path / "copy"), nproc=2)
    assert_same_weights(tmp_path / "copy", pipeline_run / "run")
    assert [m["step"] for m in read_metrics(tmp_path / "copy")] == [1, 2, 3, 4]  # each step logged once


@pytest.mark.slow
def test_a_pipeline_killed_then_resumed_ends_bit_exact(pipeline_run, tmp_path):
    out = ["--out_dir", str(tmp_path / "run")]
    proc = launch(PP_ARGS + out, nproc=2, fault="kill_after_step:3", check=False)
    assert proc.returncode != 0
    launch(PP_ARGS + out + ["--resume", "latest"], nproc=2)
    assert_same_weights(tmp_path / "run", pipeline_run / "run")


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_on_one_process_and_the_reverse(pipeline_run, single_run, tmp_path):
    """The pipeline's checkpoints are the files a DDP run writes: one process continues a pipeline's step 2, and a
    pipeline continues one process's, each ending within rounding of the one-process run.

    Seen to catch: not broken on purpose: it passed the first time."""
    launch(DDP_ARGS + resume_copy(pipeline_run / "run", 2, tmp_path / "to_one"))
    assert_weights_within_rounding(tmp_path / "to_one", single_run)
    launch(PP_ARGS + resume_copy(single_run, 2, tmp_path / "to_pipeline"), nproc=2)
    assert_weights_within_rounding(tmp_path / "to_pipeline", single_run)


# ---- the memory plan -----------------------------------------------------------------------------------------

def test_the_plan_of_a_pipeline_is_its_fuller_stage_with_the_bubble():
    """The plan of a pipeline is its fuller stage (first or last; the first holding 1F1B's micro-batches in flight); the
    stages' parameters add up to the model plus the output layer's copy; the bubble is (N-1)/(m+N-1).

    Seen to catch: not broken on purpose (new with the plan)."""
    from planner import Launch, ParamCounts, plan_memory
    from planner.render import render

    config = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024)
    stages = [ParamCounts.per_stage(config, Parallelism(pipeline_parallel=4), s) for s in range(4)]
    whole = ParamCounts.of(config)
    assert sum(s.total for s in stages) == whole.total + config.padded_vocab_size * 768  # + the output layer's copy
    assert stages[0].embeddings == whole.embeddings and stages[3].final_norm == whole.final_norm
    launch = Launch(8, Layout(4, Parallelism(pipeline_parallel=4)), accumulation=8)
    assert launch.bubble == pytest.approx(3 / 11)
    plan = plan_memory(config, launch)
    assert plan.stage in (0, 3) and plan.peak == max(plan_memory(config, launch, stage=s).peak for s in (0, 3))
    first = plan_memory(config, launch, stage=0)  # 1F1B: the first stage holds 4 micro-batches' activations
    assert first.bytes_of("activations") == 4 * 3 * first.activation_per_layer + 0  # 3 blocks, no final LayerNorm
    assert plan_memory(config, launch).peak < plan_memory(config, Launch(8, accumulation=8)).peak
    text = render(plan, 80 * 10**9)
    assert "1 pipeline(s) of 4 stages (1F1B)" in text and "= 27% of each step idle" in text


def test_the_advice_resizes_a_pipeline_by_its_pipelines():
    """A pipeline reads one stream of batches: a micro-batch the advice tries gets the accumulation the run gives it
    over the pipelines (the data-parallel ranks), not over every process (which held fewer micro-batches in flight).

    Seen to catch: `resized` over every process (what it did before): 8 micro-batches where the run has 32, fails."""
    from planner import Launch, resized
    from training.distributed.processes import BatchGeometry

    config = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024)
    layout = Layout(8, Parallelism(pipeline_parallel=4))  # 2 pipelines of 4 stages
    for micro_batch_size in (8, 4):
        run = BatchGeometry.for_total(2**19, micro_batch_size, 1024, layout.data_parallel_size)
        launch = Launch(16, layout, total_batch_size=2**19)
        assert resized(config, launch, micro_batch_size).accumulation == run.accumulation == 256 // micro_batch_size


def test_the_planner_refuses_a_pipeline_as_the_run_does():
    from planner import Launch

    with pytest.raises(UserError, match="--pipeline_parallel 2 is not supported under FSDP2"):
        Launch(1, Layout(4, Parallelism(FSDP, pipeline_parallel=2)))
    with pytest.raises(UserError, match="needs a multiple of 2 processes"):
        Launch(1, Layout(3, Parallelism(pipeline_parallel=2)))
