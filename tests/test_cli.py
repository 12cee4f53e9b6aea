"""The command lines as a user meets them: `--help`, mistyped flags, presets, log lines, and
`python -m eval.val_loss` on a run reproducing the loss the run logged."""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

from common.cli import DefaultsHelpFormatter
from common.console import TerminalBar
from common.errors import UserError, run_cli
from configs import PRESETS_DIR, _config_parser, parse_config
from configs.schema import all_groups
from training.metrics import StepLine

# ---- train.py's flags -----------------------------------------------------------------------------------


def test_help_documents_every_field_with_its_default():
    parser = _config_parser()
    formatter = DefaultsHelpFormatter("train.py")
    for f in (f for group in all_groups().values() for f in fields(group)):  # an optimizer's own flags too
        assert f.metadata.get("help"), f"{f.name} has no help"
        action = next(a for a in parser._actions if f"--{f.name}" in a.option_strings)
        shown = formatter._get_help_string(action)
        # The default is appended by the formatter, or (for None) said in the help's own words.
        assert f"(default: {f.default})" in shown if f.default not in (None, MISSING, "\n") else "default" in shown, \
            f"--{f.name}: {shown!r}"
    text = " ".join(parser.format_help().split())
    assert "MAX_STEPS optimizer steps of the whole run (default: 480)" in text
    assert "or 'auto': muon with --init_from scratch, adamw to fine-tune pretrained weights (default: auto)" in text
    assert "prompt of that sample (default: '\\n')" in text  # whitespace defaults are visible


@pytest.mark.slow
def test_the_command_line_answers_before_torch_is_imported():
    """train.py parses its flags before it imports the machinery, and the registered optimizers declare their flags
    in modules without torch (Muon's torch optimizer is a module of its own), so `python train.py --help` (Muon's flags
    in it) and a mistyped flag's one line load neither torch, accelerate nor transformers: HfArgumentParser comes from
    its own module file (`configs._hf_argument_parser`). One process runs all three through train.py's entry point;
    the figures (1.5-2 s before, ~0.3 s after) are docs/benchmarks.md's.

    Seen to catch: `from transformers import HfArgumentParser` back: the transformers modules are listed. `import torch`
    at the top of `training/optimizers/muon.py`: the torch modules are listed. train.py without its import of the
    optimizers' registry: Muon's flags are missing from `--help`."""
    code = """
import runpy, sys
for argv in (["--help"], ["--lerning_rate", "1"], ["--lr", "1e-3", "--n_layer", "2", "--plan_not"]):
    sys.argv = ["train.py", *argv]
    try:
        runpy.run_path("train.py", run_name="__main__")
    except SystemExit as stop:
        print("exit", stop.code, file=sys.stderr)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "accelerate", "transformers", "deepspeed"))
print("heavy", heavy, file=sys.stderr)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Muon (--optimizer muon):" in proc.stdout and "--muon_lr" in proc.stdout  # the optimizers' flags
    lines = proc.stderr.splitlines()
    assert lines[0] == "exit 0" and lines[-1] == "heavy []", proc.stderr[-2000:]
    assert [line for line in lines if line.startswith("error: ")] == [
        "error: unknown argument(s) --lerning_rate 1; see `python train.py --help`",
        "error: unknown argument(s) --plan_not (did you mean --plan?); see `python train.py --help`"], lines
    assert lines.count("exit 2") == 2


def test_the_first_block_of_imports_is_frozen_and_a_later_one_leaves_the_collector_alone():
    """`common.imports.imports_for_good`: the collector is off inside the block and back on after; what was imported
    is then frozen (out of every later collection); a second block in the same process (a test running train.py's
    entry point again) freezes nothing more, so the garbage made between the two stays collectable. This process
    starts as a new one does, nothing frozen, and ends as it was.

    Seen to catch: the `gc.get_freeze_count()` guard removed: the cycle made between the blocks is frozen and never
    freed. `gc.freeze()` removed: nothing is frozen."""
    import gc
    import weakref

    from common.imports import imports_for_good

    class Node:
        pass

    had_frozen = gc.get_freeze_count()
    gc.unfreeze()
    try:
        with imports_for_good():
            off_inside = not gc.isenabled()
        frozen = gc.get_freeze_count()
        node = Node()
        node.me = node
        dropped = weakref.ref(node)
        del node
        with imports_for_good():
            pass
        gc.collect()
        assert off_inside and gc.isenabled()
        assert frozen > 1000 and gc.get_freeze_count() <= frozen  # frozen objects may still be freed (refcounts)
        assert dropped() is None
    finally:
        if not had_frozen:
            gc.unfreeze()


@pytest.mark.slow
def test_a_runs_machinery_is_frozen_once_imported():
    """train.py imports torch, dynamo and accelerate inside `imports_for_good`: after `--plan` (which returns once the
    machinery is imported) the frozen objects number in the hundreds of thousands, the collector is on. The saving
    (a small run's 7.4 CPU-seconds -> 5.7, 1.1 s of collecting -> 0.2) is that block's docstring's.

    Seen to catch: train.py's imports moved out of the block: 0 objects frozen."""
    code = """
import gc, runpy, sys
sys.argv = ["train.py", "--plan", "--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32"]
try:
    runpy.run_path("train.py", run_name="__main__")
except SystemExit as stop:
    assert stop.code in (0, None), stop.code
print(gc.get_freeze_count(), gc.isenabled())
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    frozen, enabled = proc.stdout.split()[-2:]
    assert int(frozen) > 200_000 and enabled == "True", proc.stdout[-2000:]


@pytest.mark.parametrize("argv, message", [
    (["--max_step", "2"], "unknown argument(s) --max_step 2 (did you mean --max_steps?)"),  # no prefix matching
    (["--learning_rate", "1e-3"], "(did you mean --lr?)"),
    (["--learning-rate=1e-3"], "unknown argument(s) --learning-rate=1e-3 (did you mean --lr?)"),
    (["--batch_size", "4"], "(did you mean --micro_batch_size?)"),
    (["--n_layr", "2", "--max_iters", "9"], "(did you mean --n_layer for --n_layr, --max_steps for --max_iters?)"),
    (["--not_a_flag", "1"], "unknown argument(s) --not_a_flag 1; see `python train.py --help`"),
])
def test_unknown_flags_suggest_the_field(argv, message):
    with pytest.raises(UserError) as err:
        parse_config(argv)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("argv", [["--mixed_precision", "bf16"], ["--num-processes=2"], ["--bf16"]])
def test_accelerate_options_given_to_train_py_say_where_they_belong(argv):
    """accelerate's options given to train.py say where they belong.

    Seen to catch: not broken on purpose (a message's test)."""
    with pytest.raises(UserError) as err:
        parse_config(argv)
    assert f"{argv[0].split('=')[0]} is accelerate's, not train.py's" in str(err.value)
    assert "accelerate launch --mixed_precision bf16" in str(err.value)


def test_architecture_flags_that_the_weights_overrule_are_named():
    from configs import ModelConfig
    from model import GPTConfig
    from training.network import ignored_shape_flags

    gpt2 = GPTConfig(n_layer=12, n_head=12, n_embd=768)
    assert ignored_shape_flags(ModelConfig(init_from="gpt2", n_layer=8), gpt2) == ["--n_layer 8"]
    assert ignored_shape_flags(ModelConfig(init_from="gpt2"), gpt2) == []  # the defaults: nothing was asked
    assert ignored_shape_flags(ModelConfig(init_from="gpt2", n_layer=12), gpt2) == []  # what the weights have
    assert ignored_shape_flags(ModelConfig(n_layer=8), gpt2) == []  # from scratch the flags are the shape


def test_dashed_spellings_are_the_same_flags():
    assert parse_config(["--max-steps", "7", "--micro-batch-size", "4"]) == \
        parse_config(["--max_steps", "7", "--micro_batch_size", "4"])


def test_a_preset_given_first_is_the_config():
    preset = str(PRESETS_DIR / "gpt2_124m_fineweb_edu.yaml")
    cfg = parse_config([preset, "--max_steps", "5"])
    assert (cfg.preset.config, cfg.model.n_layer, cfg.training.max_steps) == ([preset], 12, 5)
    assert cfg == parse_config(["--config", preset, "--max_steps", "5"])
    with pytest.raises(UserError, match=re.escape("a preset given first must be a .yaml file")):
        parse_config(["config/train_shakespeare_char.py"])


def test_yaml_errors_name_the_line(tmp_path: Path):
    preset = tmp_path / "p.yaml"
    preset.write_text("n_layer: 2\nlr: 3\n  warmup_steps: 1\n")
    with pytest.raises(UserError) as err:
        parse_config(["--config", str(preset)])
    assert "is not valid YAML (line 3, column 15: mapping values are not allowed here)" in str(err.value)


def test_unknown_preset_fields_suggest_the_field(tmp_path: Path):
    preset = tmp_path / "p.yaml"
    preset.write_text("learning_rate: 1e-3\nzzz: 1\n")
    with pytest.raises(UserError, match=re.escape("unknown field(s) learning_rate, zzz (did you mean "
                                                  "lr for learning_rate, the flag --lr?)")):  # issue 55: no --
        parse_config(["--config", str(preset)])


# ---- the other entry points: same style, one-line errors ---------------------------------------------------

def _entry_points(monkeypatch):
    """(name, main taking argv) of every CLI besides train.py."""
    from data import prepare
    from eval import hellaswag, val_loss
    from publish import hub

    def prepare_main(argv):
        monkeypatch.setattr(sys, "argv", ["prepare", *argv])
        return prepare.main()

    return {"eval.val_loss": val_loss.main, "eval.hellaswag": hellaswag.main, "data.prepare": prepare_main,
            "publish.hub": hub.main}


@pytest.mark.parametrize("name, argv, message", [
    ("eval.val_loss", ["--model", "m", "--batch_sze", "2"], "unknown argument(s) --batch_sze 2 (did you mean "
                                                            "--batch_size?); see `python -m eval.val_loss --help`"),
    ("eval.hellaswag", ["--model", "m", "--limt", "2"], "(did you mean --limit?)"),
    ("eval.hellaswag", ["--model", "m", "--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    ("data.prepare", ["--dataset", "x", "--out", "y", "--shard_token", "5"], "(did you mean --shard_tokens?)"),
    ("publish.hub", ["--run_dir", "r"], "the following arguments are required: --hub_model_id/--hub-model-id; "
                                        "see `python -m publish.hub --help`"),
])
def test_entry_point_errors_are_one_line(monkeypatch, capsys, name, argv, message):
    main = _entry_points(monkeypatch)[name]
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("name", ["eval.val_loss", "eval.hellaswag", "data.prepare", "publish.hub"])
def test_entry_point_help_shows_each_default_once(monkeypatch, capsys, name):
    with pytest.raises(SystemExit) as exit_info:
        _entry_points(monkeypatch)[name](["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"usage: python -m {name}" in text
    assert "(default: None)" not in text and not re.search(r"\(default: [^)]*\) \(default:", text)
    if name == "data.prepare":
        assert "tokenizer threads (default: all cores)" in text


# ---- the console ---------------------------------------------------------------------------------------------

def test_the_bar_is_drawn_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert not TerminalBar(total=1).disable
    assert TerminalBar(total=1, show=False).disable  # not the main process
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert TerminalBar(total=1).disable


def test_step_line(monkeypatch):
    clock = iter([100.0, 131.0])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    line = StepLine(max_steps=150, start_step=0)
    record = {"loss": 6.41234, "lr": 9.6e-4, "grad_norm": 0.8123, "tok_per_sec": 1120.4, "mfu": None}
    assert line.format(30, record) == ("step 30/150 | loss 6.412 | lr 9.6e-04 | grad 0.81 | 1,120 tok/s | mfu - | "
                                       "0:00:31 elapsed, 0:02:04 left")
    clock = iter([50.0, 50.0])
    assert StepLine(150, 0).format(150, {**record, "mfu": 0.4123}).endswith("mfu 41.2% | 0:00:00 elapsed, 0:00:00 left")
    clock = iter([50.0, 50.0, 50.0, 50.0])
    assert "mfu - | 0:00" in StepLine(150, 0).format(150, record, data_share=0.02)  # a few percent: not named
    assert "mfu - | data 7% | 0:00" in StepLine(150, 0).format(150, record, data_share=0.07)


def test_the_run_clock_splits_the_wall_time_by_phase(monkeypatch):
    from training.timing import CHECKPOINT, DATA, EVAL, STEP, RunClock

    now = iter([0.0, 0.0, 6.0, 6.0, 7.0, 7.0, 8.5, 9.0, 9.5, 10.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(now))
    clock = RunClock()  # 0
    with clock.phase(STEP):  # 0 - 6
        pass
    with clock.phase(DATA) as waiting:  # 6 - 7
        pass
    with clock.phase(EVAL):  # 7 - 8.5
        pass
    with clock.phase(CHECKPOINT):  # 9 - 9.5
        pass
    assert waiting.seconds == 1.0 and clock.since_last(DATA) == 1.0 and clock.since_last(DATA) == 0.0
    assert clock.summary() == "time 0:00:10: step 60% | data 10% | evaluation 15% | checkpoint 5% | other 10%"


# ---- a tiny fine-tuning run, in this process ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, str, str]:
    """3 steps of train.py from a 1-layer HF GPT-2 folder, the architecture flags left at their defaults
    (6 layers, 4 heads, 48 wide); its run folder, stdout and stderr (not a terminal)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import train

    tmp = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp / "hf")
    out = tmp / "run"
    args = ["--init_from", str(tmp / "hf"), "--block_size", "32", "--val_tokens", "300", "--eval_batch_size", "3",
            "--sample_tokens", "2", "--micro_batch_size", "2", "--total_batch_size", "64", "--max_steps", "3",
            "--log_every", "1", "--eval_every", "2", "--save_every", "2", "--out_dir", str(out)]
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(stdout), redirect_stderr(stderr):
        mp.setattr(sys, "argv", ["train.py", *args])
        train.run_cli(train.main)
    return out, stdout.getvalue(), stderr.getvalue()


def test_config_yaml_records_the_loaded_architecture(tiny_run):
    out, _, _ = tiny_run
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert (recorded["n_layer"], recorded["n_head"], recorded["n_embd"], recorded["block_size"]) == (1, 2, 32, 32)


def test_logs_are_plain_lines_without_bars(tiny_run):
    _, stdout, stderr = tiny_run
    assert "\r" not in stdout + stderr  # no progress bar when stderr is not a terminal
    steps = [line for line in stdout.splitlines() if line.startswith("step ") and " | " in line]
    assert [s.split(" | ")[0] for s in steps] == ["step 1/3", "step 2/3", "step 3/3"]
    # The data wait is named when it is a noticeable share of the steps (a busy machine: `StepLine.format`).
    pattern = (r"step \d/3 \| loss \d+\.\d{3} \| lr \d\.\de-\d\d \| grad \d+\.\d\d \| [\d,]+ tok/s \| mfu - "
               r"(\| data \d+% )?\| \d+:\d\d:\d\d elapsed, \d+:\d\d:\d\d left")
    assert all(re.fullmatch(pattern, s) for s in steps), steps
    assert re.search(r"^step 2: val_loss \d+\.\d{4}$", stdout, re.M)


@pytest.mark.parametrize("where", ["", "final", "checkpoints/step_000003"])
def test_val_loss_of_a_run_reproduces_the_logged_loss(tiny_run, capsys, where):
    from eval.val_loss import main

    out, _, _ = tiny_run
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert logged["step"] == 3
    assert main(["--model", str(out / where), "--device", "cpu"]) == logged["val_loss"]  # exactly: same windows
    assert f"settings from {out / 'config.yaml'}" in capsys.readouterr().out
    # A flag the user passes wins over the run's setting.
    assert main(["--model", str(out), "--max-tokens", "100", "--batch-size", "2"]) != logged["val_loss"]


def test_an_error_line_is_one_write_with_its_newline(monkeypatch):
    """Processes share stderr (a launch's ranks, torch elastic's agent): a line written in two parts can get another
    process's line between them (CI, 2026-11-26: the agent's warning glued to our line), so it is one write.

    Seen to catch: `print(..., file=sys.stderr)` (two writes): fails. Found in CI, where
    `test_elastic.py::test_an_error_of_one_rank_is_one_line_and_stops_after_the_first_restart[3]` read torch elastic's
    warning glued to our line."""
    import io

    from common.errors import print_error

    writes = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Recorder())
    print_error("what is wrong; what to do")
    assert writes == ["error: what is wrong; what to do\n"]


@pytest.mark.parametrize("flag", ["--num_train_epochs", "--epochs", "--num-epochs"])
def test_epochs_get_the_steps_of_one_epoch(flag):
    """HF Trainer's --num_train_epochs (nanoGPT and Keras users' --epochs): train.py counts steps, so the line names
    --max_steps and what one epoch of this data is at these flags, counted as the loader counts (the last 10% of
    Tiny Shakespeare validates; a step reads total_batch_size / block_size windows of block_size + 1 tokens). Seen to
    catch (issue 60): a bare "unknown argument(s) --num_train_epochs 3" with no hint."""
    import math

    from data import get_tokenizer
    from data.source import SHAKESPEARE_FILE

    tokens = len(get_tokenizer().encode_ordinary(SHAKESPEARE_FILE.read_text()))
    windows = (int(tokens * 0.9) - 1) // 128
    steps = math.ceil(windows / (512 // 128))
    with pytest.raises(UserError) as err:
        parse_config([flag, "3"])
    assert str(err.value) == (
        f"{flag} 3: train.py counts optimizer steps, not epochs; pass --max_steps: one epoch of shakespeare is "
        f"{steps:,} steps of 512 tokens ({windows:,} windows of 128 tokens), so 3 epochs is --max_steps {3 * steps}")


def test_epochs_of_a_streamed_dataset_say_why_there_is_no_count():
    with pytest.raises(UserError, match=r"^--epochs 1: train.py counts optimizer steps, not epochs; pass --max_steps: "
                                        r"the size of a streamed Hub dataset is not known ahead"):
        parse_config(["--dataset", "HuggingFaceFW/fineweb-edu:sample-10BT", "--epochs", "1"])
