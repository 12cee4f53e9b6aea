"""Fault injection: every file of a checkpoint damaged every way, NaN blow-ups, two runs in one folder,
errors under two processes. Each case ends in one line and exit status 2 with nothing changed, or in a
resume that ends bit-identical to the uninterrupted run; never a traceback, never executed code.

One small run (2 checkpoints) is made once; each case works on a copy of it.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    REPO_ROOT,
    TINY,
    assert_same_weights,
    free_port,
    launch,
    read_metrics,
    run_in_process,
    train_in_process,
    tree_digest,
)

import train
from checkpoint_io.manifest import weights_file
from checkpoint_io.weights import resolve_weights
from common.errors import UserError
from training.checkpoints.resume import find_resume_point, verify_checkpoint

# 4 steps, a checkpoint at 2 and 4, dropout so that a lost RNG state would change the weights.
RUN = TINY + ["--max_steps", "4", "--micro_batch_size", "2", "--total_batch_size", "64", "--save_every", "2",
              "--eval_every", "4", "--dropout", "0.1"]
FILES = ["model.safetensors", "optimizer.bin", "random_states_0.pkl", "data_state_rank0.json", "run_state.json",
         "gpt_config.json", "manifest.json"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "run"
    launch(RUN + ["--out_dir", str(out)])
    return out


@pytest.fixture
def run_copy(reference, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    return out



def train_until_error(monkeypatch, capsys, args: list[str]) -> str:
    """train.py's entry point in this process, for runs that fail after the progress bar started: exit status
    2, no traceback, the error alone on the last line of stderr (which the function returns)."""
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        train.run_cli(train.main)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n")
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: "), err
    return last


class WritesAMarker:
    """A pickle that would create a file when loaded by a plain `pickle.load`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def damage(file: Path, how: str, marker: Path) -> None:
    data = file.read_bytes()
    if how == "delete":
        file.unlink()
    elif how == "truncate":
        file.write_bytes(data[: len(data) // 2])
    elif how == "garbage":  # same size, other bytes: only the hash can tell
        file.write_bytes(bytes((b + 1) % 256 for b in data))
    elif how == "pickle":
        file.write_bytes(pickle.dumps(WritesAMarker(marker)))


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("how", ["delete", "truncate", "garbage", "pickle"])
def test_every_damaged_checkpoint_file_is_refused_by_name(run_copy, tmp_path, name, how):
    """A damaged checkpoint is refused before anything is loaded. On a real run's checkpoint, each of the 28 damages:
    the readers refuse it exactly where a weights file is damaged, naming step_000002, and read it where only a resume's
    file is (the cases the quick tests build by hand, on the files a run writes).

    Seen to catch: the sha256 comparison skipped."""
    newest = run_copy / "checkpoints" / "step_000004"
    marker = tmp_path / "code_was_run"
    damage(newest / name, how, marker)
    if (name, how) == ("gpt_config.json", "delete"):
        # Without it the folder is not a complete checkpoint (a save publishes it last but for the manifest):
        # the newest complete one is resumed, exactly, and says so.
        assert find_resume_point("latest", run_copy).path.name == "step_000002"
        return
    with pytest.raises(UserError) as err:
        verify_checkpoint(find_resume_point("latest", run_copy))
    message = str(err.value)
    assert "\n" not in message and name in message
    if name != "manifest.json":  # the advice names the checkpoint to fall back to
        assert f"--resume {run_copy / 'checkpoints' / 'step_000002'}" in message
    # Every command that reads the weights (export, sample, eval.*, publish.hub, --init_from) checks the same
    # checkpoint: the weights' own files as a resume does, naming the newest intact one; a resume's alone not at all.
    if weights_file(name):
        with pytest.raises(UserError, match=rf"{name}.*; the newest intact checkpoint before it is "
                                            rf"{run_copy / 'checkpoints' / 'step_000002'}: pass that folder instead$"):
            resolve_weights(newest)
    else:
        assert resolve_weights(newest).folder == newest
    assert not marker.exists()


@pytest.mark.slow
def test_a_checkpoint_without_manifest_still_refuses_a_bad_rng_state_and_never_runs_it(run_copy, tmp_path):
    """Checkpoints from before manifests resume (presence checks) but a damaged RNG pickle, which accelerate
    would skip with an info-level log, is refused, and its code is never run.

    Seen to catch: the RNG pre-read removed."""
    newest = run_copy / "checkpoints" / "step_000004"
    (newest / "manifest.json").unlink()  # as written before manifests (run_state format 1)
    state = json.loads((newest / "run_state.json").read_text())
    del state["format"]
    (newest / "run_state.json").write_text(json.dumps(state))
    verify_checkpoint(find_resume_point("latest", run_copy))  # an old, intact checkpoint is fine
    marker = tmp_path / "code_was_run"
    damage(newest / "random_states_0.pkl", "pickle", marker)
    with pytest.raises(UserError, match="random_states_0.pkl cannot be read"):
        verify_checkpoint(find_resume_point("latest", run_copy))
    assert not marker.exists()


@pytest.mark.slow
def test_train_py_refuses_a_damaged_checkpoint_then_resumes_from_the_earlier_one_exactly(run_copy, reference,
                                                                                       monkeypatch, capsys):
    (run_copy / "checkpoints" / "step_000004" / "random_states_0.pkl").unlink()
    before = tree_digest(run_copy)
    err = run_in_process(monkeypatch, capsys, RUN + ["--out_dir", str(run_copy), "--resume", "latest"])
    assert "random_states_0.pkl is missing; resume from the checkpoint before it with --resume" in err
    assert tree_digest(run_copy) == before
    # Following the advice: step 2, then steps 3-4 again, bit for bit; the damaged step 4 is set aside.
    earlier = run_copy / "checkpoints" / "step_000002"
    launch(RUN + ["--out_dir", str(run_copy), "--resume", str(earlier)])
    assert_same_weights(reference, run_copy)
    assert [r["step"] for r in read_metrics(run_copy)] == [r["step"] for r in read_metrics(reference)]
    assert len(list((run_copy / "superseded").glob("*/step_000004"))) == 1


@pytest.mark.slow
def test_resuming_a_finished_run_says_it_had_finished(run_copy):
    """`--resume latest` of a finished run with its own --max_steps (a requeued job, a command run twice): it trains
    nothing and writes final/ again, and now says the run had finished (it said only `resumed from ... at step 4`).

    Seen to catch: the line's condition off (`if False:`): fails."""
    logged = read_metrics(run_copy)
    stdout, _ = train_in_process(RUN + ["--out_dir", str(run_copy), "--resume", "latest"])
    assert (f"resumed from {run_copy / 'checkpoints' / 'step_000004'} at step 4 (256 tokens)\nthe run had already "
            "finished: step 4 is its --max_steps, so nothing is trained; final/ is written again from the same weights "
            "(pass a larger --max_steps to train on)\n") in stdout
    assert read_metrics(run_copy) == logged  # no step trained or logged again


@pytest.mark.slow
def test_a_checkpoint_past_max_steps_is_refused(run_copy, monkeypatch, capsys):
    before = tree_digest(run_copy)
    args = RUN + ["--out_dir", str(run_copy), "--resume", "latest", "--max_steps", "3"]
    assert "is at step 4, past --max_steps 3; pass a larger --max_steps" in run_in_process(monkeypatch, capsys, args)
    assert tree_digest(run_copy) == before


# ---- a resume that changes the recipe (training/recipe.py) ------------------------------------------------

def test_every_config_field_has_a_resume_rule():
    """Refused, accepted (announced and recorded) or not compared: a decision for each field, a new one too.

    The recipe check reads the declarations (`common/resume_rules.py`).

    Seen to catch: before the rules moved to the fields: `hub_push_every` left out of `ACCEPTED`. Since: `--seed`
    declared `ACCEPTED` at its field, and the `--seed` case of the (slow) refusal test fails."""
    from configs.schema import field_names
    from training.recipe import FlagRules

    rules = FlagRules.now()
    groups = [set(rules.refused), set(rules.accepted), set(rules.not_compared)]
    assert sorted(name for group in groups for name in group) == sorted(field_names())  # each once, none missing
    assert {"muon_lr", "muon_momentum"} <= set(field_names())  # the registered optimizers' own flags too


@pytest.mark.parametrize("now,same", [("gpt2", True), ("gpt2@main", True), ("gpt2@" + "b" * 40, False),
                                      ("gpt2-medium", False), ("scratch", False)])
def test_init_from_without_a_commit_resumes_a_fine_tune_pinned_to_one(tmp_path, now, same):
    """A full fine-tune's resume downloads nothing, so `--init_from gpt2` (or `gpt2@main`, requeued as it was
    given) cannot be resolved to the commit config.yaml records: the repo ids are compared and the pin is kept.
    Another commit or other weights are refused.

    Seen to catch: the repo-id rule off: both same-weights cases are refused."""
    import yaml

    from configs import ModelConfig, OptimConfig
    from training.checkpoints.resume import ResumePoint
    from training.optimizers.plan import plan_optimizers
    from training.recipe import resume_recipe

    pinned = "gpt2@" + "a" * 40
    (tmp_path / "run" / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump({"init_from": pinned, "max_steps": 4}))
    point = ResumePoint(tmp_path / "run" / "checkpoints" / "step_000002", {}, {"step": 2, "tokens": 0, "run_id": "x"})
    plan = plan_optimizers(OptimConfig(), ModelConfig(init_from="gpt2"))
    if same:
        assert resume_recipe({"init_from": now, "max_steps": 4}, point, plan).values["init_from"] == pinned
    else:
        with pytest.raises(UserError, match=f"records init_from '{re.escape(pinned)}' and this resume passes "
                                            f"'{now}'.*resume with --init_from {pinned} as recorded"):
            resume_recipe({"init_from": now, "max_steps": 4}, point, plan)


def test_every_refused_change_of_a_resume_is_in_its_one_line(tmp_path):
    """A resume that changes several refused fields (a run started before issue 55 changed the defaults, resumed
    with the same command) names them all, and the fix that resumes is one command: every flag as recorded.

    Seen to catch: only the first refused change raised (`refused = refused[:1]`): the line names total_batch_size
    alone."""
    import yaml

    from configs import ModelConfig, OptimConfig
    from training.checkpoints.resume import ResumePoint
    from training.optimizers.plan import plan_optimizers
    from training.recipe import resume_recipe

    (tmp_path / "run" / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump({"total_batch_size": 2048, "beta2": 0.95,
                                                                  "max_steps": 4}))
    point = ResumePoint(tmp_path / "run" / "checkpoints" / "step_000002", {}, {"step": 2, "tokens": 0, "run_id": "x"})
    plan = plan_optimizers(OptimConfig(), ModelConfig())
    with pytest.raises(UserError) as refused:
        resume_recipe({"total_batch_size": 512, "beta2": 0.99, "max_steps": 4}, point, plan)
    line = str(refused.value)
    assert "records total_batch_size 2048, beta2 0.95 and this resume passes 512, 0.99" in line
    assert "resume with --total_batch_size 2048 --beta2 0.95 as recorded" in line and "\n" not in line


@pytest.mark.slow
@pytest.mark.parametrize("flag,old,new", [("--total_batch_size", "64", "128"), ("--seed", "1337", "7"),
                                          ("--beta2", "0.99", "0.95")])
def test_a_resume_that_changes_the_recipe_is_refused_in_one_line(run_copy, monkeypatch, capsys, flag, old, new):
    """The batch in tokens, the data order, and what the optimizer state restores: refused before anything is
    written, naming the field, both values and the fix.

    Seen to catch: the refusal in `training/recipe.py` skipped (`elif False:`): total_batch_size and beta2 resumed
    without a word, and seed refused only later, by the data position, in other words."""
    before = tree_digest(run_copy)
    err = run_in_process(monkeypatch, capsys, RUN + ["--out_dir", str(run_copy), "--resume", "latest", flag, new])
    name = flag.removeprefix("--")
    assert f"config.yaml records {name} {float(old) if '.' in old else int(old)!r} and this resume passes " in err
    assert f"resume with {flag} {old} as recorded, or start a new run in another --out_dir (with --init_from " in err
    assert tree_digest(run_copy) == before


@pytest.mark.slow
def test_a_resume_that_extends_the_run_is_announced_and_recorded_as_a_new_segment(run_copy):
    """The finished 4-step run extended to 6 steps with another micro-batch: each change in one line, the LR jump
    at step 5 in one line (the cosine stretched over 6 steps: 3e-4 on the old schedule's end, 1.65e-3 now), and
    config.yaml keeps its keys (today's values) with a `resumes` entry that keeps the old ones. A later resume
    that changes nothing keeps that record.

    Seen to catch: `config_yaml()` without the entry (`KeyError: 'resumes'`); the LR line not printed."""
    import yaml

    from configs import read_run_config
    from training.step import LRSchedule

    args = RUN + ["--out_dir", str(run_copy), "--resume", "latest", "--max_steps", "6", "--micro_batch_size", "1",
                  "--log_every", "1"]
    stdout, _ = train_in_process(args)
    old_lr, new_lr = (3e-3 * LRSchedule(2, steps, 0.1).factor(4) for steps in (4, 6))
    assert (round(old_lr, 6), round(new_lr, 6)) == (3e-4, 1.65e-3)
    for line in ("resuming at step 4 with max_steps 4 -> 6 (config.yaml records it under 'resumes')",
                 "resuming at step 4 with micro_batch_size 2 -> 1 (config.yaml records it under 'resumes')",
                 "resuming at step 4 with log_every 10 -> 1 (config.yaml records it under 'resumes')",
                 f"the learning rate changes at step 5: {old_lr:.4g} -> {new_lr:.4g} (adamw), the LR being a function "
                 "of the step and of max_steps (config.yaml records it under 'resumes')"):
        assert line in stdout.splitlines(), stdout
    assert next(r["lr"] for r in read_metrics(run_copy) if r["step"] == 5) == pytest.approx(new_lr)  # as announced
    recorded = yaml.safe_load((run_copy / "config.yaml").read_text())
    assert (recorded["max_steps"], recorded["micro_batch_size"], recorded["lr"]) == (6, 1, 3e-3)
    checkpoint = str(run_copy / "checkpoints" / "step_000004")
    segment = {"step": 4, "checkpoint": checkpoint,
               "changed": {"max_steps": {"old": 4, "new": 6}, "micro_batch_size": {"old": 2, "new": 1},
                           "log_every": {"old": 10, "new": 1}},
               "lr_jump": {"step": 5, "adamw": {"old": pytest.approx(old_lr), "new": pytest.approx(new_lr)}}}
    assert recorded["resumes"] == [segment]
    assert read_run_config(run_copy / "config.yaml")["dataset"] == "shakespeare"  # what eval.val_loss reads
    assert "resumes:" in (run_copy / "final" / "README.md").read_text()  # the card shows the record

    stdout, _ = train_in_process(args)  # at step 6 of 6: nothing to change, nothing to train
    assert "resuming at step" not in stdout
    assert yaml.safe_load((run_copy / "config.yaml").read_text())["resumes"] == [segment]


@pytest.mark.slow
def test_a_warmup_longer_than_the_run_is_a_warning_with_its_reason(tmp_path):
    """A run whose warmup outlasts it never reaches its peak LR: one warning line saying so, and the run goes on
    (the default 10-step warmup outlasts a 3-step smoke run). Extended past the warmup by a resume: no warning.

    Seen to catch: the warning not printed."""
    out = tmp_path / "run"
    args = TINY + ["--out_dir", str(out), "--micro_batch_size", "2", "--total_batch_size", "64", "--save_every", "2",
                   "--eval_every", "100", "--warmup_steps", "10"]
    _, stderr = train_in_process(args + ["--max_steps", "2"])
    assert ("warning: --warmup_steps 10 is longer than the run (--max_steps 2): the learning rate never reaches its "
            "peak (it ends at 20% of it); pass --warmup_steps 2 or less (e.g. a tenth of the run) or a larger "
            "--max_steps for the schedule you meant") in stderr.splitlines(), stderr
    assert (out / "final" / "model.safetensors").is_file()
    stdout, stderr = train_in_process(args + ["--max_steps", "12", "--resume", "latest"])
    assert "resuming at step 2 with max_steps 2 -> 12" in stdout and "warning: --warmup_steps" not in stderr


# ---- runaway training: nothing non-finite is ever kept or named as good --------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("on_nan", ["stop", "skip"])
def test_an_exploding_run_keeps_only_good_checkpoints(tmp_path, monkeypatch, capsys, on_nan):
    """lr 1e6: the first update leaves finite but useless weights whose loss is not finite. That state is
    never saved (or named as the last good one), and --on_nan skip does not skip forever.

    Seen to catch: the health check skipped."""
    out = tmp_path / "run"
    args = TINY + ["--out_dir", str(out), "--max_steps", "30", "--micro_batch_size", "2", "--total_batch_size", "64",
                   "--lr", "1e6", "--warmup_steps", "1", "--save_every", "1", "--on_nan", on_nan,
                   "--max_nan_skips", "3"]
    assert "last good checkpoint: None" in train_until_error(monkeypatch, capsys, args)
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").glob("step_*"))
    assert not (out / "final").exists()


def test_skipped_steps_are_bounded(tmp_path):
    """`--on_nan skip` stops after `--max_nan_skips` in a row.

    Seen to catch: the bound removed."""
    from accelerate import Accelerator

    from common.run_dir import RunDir
    from training.step import NonFinitePolicy

    policy = NonFinitePolicy("skip", 2, RunDir(tmp_path), Accelerator(cpu=True))
    policy.after_step(1, float("nan"))
    policy.after_step(2, 1.0)  # a good step resets the count
    policy.after_step(3, float("inf"))
    policy.after_step(4, float("nan"))
    with pytest.raises(UserError, match=r"at step 5 \(3 steps in a row, over --max_nan_skips 2\)"):
        policy.after_step(5, float("nan"))


# ---- one run per folder -------------------------------------------------------------------------------------

def test_a_second_run_in_a_locked_folder_is_refused(tmp_path, monkeypatch, capsys):
    """One run per `--out_dir`.

    Seen to catch: the lock not taken."""
    from filelock import FileLock

    out = tmp_path / "run"
    out.mkdir()
    holder = FileLock(out / ".lock")  # another run's lock (a separate lock object, as another process has)
    holder.acquire()
    try:
        err = run_in_process(monkeypatch, capsys, TINY + ["--out_dir", str(out), "--max_steps", "1"])
    finally:
        holder.release()
    assert f"another run is writing into {out}" in err
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_a_lock_file_left_by_a_dead_run_is_no_obstacle(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text("")  # left behind by a killed run: nobody holds it
    train_in_process(TINY + ["--out_dir", str(out), "--max_steps", "1", "--micro_batch_size", "2",
                             "--total_batch_size", "64"])
    assert (out / "final" / "model.safetensors").is_file()


# ---- two processes: an error is printed once and every rank exits 2 --------------------------------------

@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_error_of_every_rank_is_printed_when_rank_0_is_the_slowest(tmp_path):
    """Rank 1 finds the error 5 s before rank 0 (a busy machine): it waits for rank 0 to print it instead of exiting
    first, which made the launcher stop rank 0 (SIGTERM) before its line, and the user read no error at all.

    Seen to catch: rank 1 exiting at once (`_leave_the_report_to_rank_0` not called): no `error:` line, rank 0 ended by
    SIGTERM. This failed the README's suite on a busy machine before the fix."""
    proc = launch(TINY + ["--out_dir", str(tmp_path / "r"), "--lr", "-1"], nproc=2, fault="slow_rank_0:5",
                  check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "error: --lr must be positive" in errors[0], proc.stderr[-3000:]
    assert proc.returncode != 0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_process_errors_print_once(tmp_path):
    """A refusal found during setup (the ranks agree on it), under torchrun rather than accelerate: printed once. (A
    config error, which every rank parses alike: the test above.)

    Seen to catch: every rank printing; later, the setup refusal alone printed twice (`print_error` before the other
    ranks' wait)."""
    finished = tmp_path / "finished"
    (finished / "final").mkdir(parents=True)
    (finished / "final" / "config.json").write_text("{}")
    cases = [(["--out_dir", str(finished), "--resume", "latest"], "holds a finished run (final/)")]
    script = ";".join([
        "import os, runpy, sys",
        "sys.argv = ['train.py', *sys.argv[1:]]",
        "runpy.run_path('train.py', run_name='__main__')",
    ])
    for args, message in cases:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "--no-python", sys.executable, "-c", script, *RUN, "--total_batch_size", "128",
               "--out_dir", str(tmp_path / "new"), *args]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
        # torchrun's summary: the first rank to finish exited 2 (the launcher then stops the other, by SIGTERM
        # if it is still shutting down).
        assert "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
        assert "raise UserError" not in proc.stderr  # no worker traceback


# ---- the disk fills up -------------------------------------------------------------------------------------

@pytest.mark.parametrize("at", ["first save_state", "save_state", "export"])
def test_a_full_disk_is_one_line_and_keeps_the_earlier_checkpoints(tmp_path, monkeypatch, capsys, at):
    """ENOSPC in the second checkpoint (or in final/): one line, no partial folder, the first checkpoint intact,
    and --resume latest then finishes the run. In the first checkpoint: the line says there is none yet (it said
    the earlier ones were intact), and --resume latest runs it again from the start.

    Seen to catch: the partial folder not removed. For the first save: the old message back ("the earlier checkpoints
    are intact")."""
    import errno

    from accelerate import Accelerator

    import training.checkpoints.export

    out = tmp_path / "run"
    args = TINY + ["--out_dir", str(out), "--max_steps", "4", "--micro_batch_size", "2", "--total_batch_size", "64",
                   "--save_every", "2", "--eval_every", "4"]
    full = OSError(errno.ENOSPC, "No space left on device")
    if at.endswith("save_state"):
        save_state = Accelerator.save_state
        full_at = "step_000002" if at.startswith("first") else "step_000004"

        def save_state_until_full(self, output_dir=None, **kwargs):
            if output_dir.endswith(full_at):
                (Path(output_dir) / "model.safetensors").write_bytes(b"partial")
                raise full
            return save_state(self, output_dir, **kwargs)

        monkeypatch.setattr(Accelerator, "save_state", save_state_until_full)
    else:
        def full_export(state, config, directory, overwrite=False):
            (Path(directory) / "model.safetensors").write_bytes(b"partial")
            raise full

        monkeypatch.setattr(training.checkpoints.export, "save_state_dict", full_export)
    last = train_until_error(monkeypatch, capsys, args)
    assert last.startswith("error: could not write ") and "No space left on device" in last
    assert not list(out.rglob(".tmp-*")) and not (out / "final").exists()
    expected = {"first save_state": [], "save_state": ["step_000002"], "export": ["step_000002", "step_000004"]}[at]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == expected
    if at == "first save_state":
        assert "no checkpoint yet" in last and "intact" not in last, last
    elif at == "save_state":
        assert "the earlier checkpoints are intact" in last
    monkeypatch.undo()
    train_in_process(args + ["--resume", "latest"])
    assert (out / "final" / "model.safetensors").is_file()


def test_a_refused_resume_leaves_no_lock_file_it_did_not_find(tmp_path, monkeypatch, capsys):
    """A run folder without .lock (copied, downloaded), resumed with another model config: refused in one line,
    and the folder is as it was (byte for byte, no .lock). A .lock that was there stays.

    Seen to catch: the unlink on an error removed: `.lock` left behind."""
    out = tmp_path / "run"
    args = TINY + ["--out_dir", str(out), "--max_steps", "2", "--micro_batch_size", "2", "--total_batch_size", "64",
                   "--save_every", "1", "--max_steps", "1"]
    train_in_process(args)
    (out / ".lock").unlink()
    before = tree_digest(out)
    err = run_in_process(monkeypatch, capsys, args + ["--resume", "latest", "--max_steps", "2", "--n_layer", "3"])
    assert "was trained with another model config" in err
    assert tree_digest(out) == before and not (out / ".lock").exists()
    (out / ".lock").write_text("")
    run_in_process(monkeypatch, capsys, args + ["--resume", "latest", "--max_steps", "2", "--n_layer", "3"])
    assert (out / ".lock").exists()


@pytest.mark.slow
@pytest.mark.parametrize("flag,new", [("--lr", "0.005"), ("--micro_batch_size", "1")])
def test_a_finished_run_resumed_with_a_change_is_refused(run_copy, monkeypatch, capsys, flag, new):
    """Issue 44: the finished 4-step run resumed with another setting and no step left trained nothing, yet recorded
    the change in config.yaml and rewrote final/'s card with it (exit 0). Now one line, nothing touched.

    Seen to catch: the check off (`if False:`): both cases (`--lr`, `--micro_batch_size`) fail."""
    before = tree_digest(run_copy)
    err = run_in_process(monkeypatch, capsys, RUN + ["--out_dir", str(run_copy), "--resume", "latest", flag, new])
    assert f"is where this run finished (step 4 of --max_steps 4): a resume trains no step, so nothing would use " \
           f"{flag}; pass a --max_steps above 4 to train on" in err
    assert tree_digest(run_copy) == before


@pytest.mark.slow
def test_a_folder_another_run_writes_into_is_refused_as_such_before_its_contents(run_copy, monkeypatch, capsys):
    """Issue 44: a second run in a folder while the first runs was told "already holds a run; pass --resume
    latest", which then met the lock. The lock is judged first: the advice that works is to wait.

    Seen to catch: the probe removed from train.py: "already holds a run" comes first and the test fails."""
    from filelock import FileLock

    before = tree_digest(run_copy)
    holder = FileLock(run_copy / ".lock")  # the first run's lock (another lock object, as another process has)
    holder.acquire()
    try:
        for resume in ([], ["--resume", "latest"]):
            err = run_in_process(monkeypatch, capsys, RUN + ["--out_dir", str(run_copy), *resume])
            assert f"another run is writing into {run_copy}" in err and "already holds a run" not in err
    finally:
        holder.release()
    assert tree_digest(run_copy) == before


@pytest.mark.slow
def test_no_sample_prints_no_sample_block(tmp_path):
    """Issue 44: --sample_tokens 0 still printed an empty `---` block at every validation.

    Seen to catch: the check off: the `---` lines come back and the test fails."""
    stdout, _ = train_in_process(TINY + ["--out_dir", str(tmp_path / "run"), "--max_steps", "2", "--eval_every", "1",
                                         "--sample_tokens", "0", "--warmup_steps", "1", "--micro_batch_size", "2",
                                         "--total_batch_size", "64"])
    assert "step 1: val_loss" in stdout and "step 2: val_loss" in stdout
    assert "---" not in stdout.splitlines()
