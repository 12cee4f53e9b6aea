"""Ctrl-C keeps the work: the first one finishes the step, saves it, says how to resume and exits; a second one
stops at once, keeping what was saved. Each resumed run ends with the weights of an uninterrupted one.

The Ctrl-C comes from tests/fault_train.py (`ctrl_c_in_step:N`) as step N begins, so the step it lands in is
known: SIGINT to the process, or, under `accelerate launch`, to the launcher, which is where a terminal sends it
(torch's elastic agent runs the workers in sessions of their own and forwards the signal to them).

The resume is bit-exact on 1 process and on 2 under `accelerate launch`.

Seen to catch: SIGINT not handled (the first Ctrl-C is `error: interrupted`, nothing saved); the second Ctrl-C only
setting the flag (step 4 saved, exit 0).
"""
from __future__ import annotations

import os
import signal
import sys
from functools import partial

import pytest
from conftest import DDP_ARGS, RESUME_ARGS, assert_same_weights, launch, read_metrics


def saved_steps(out) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*"))


@pytest.mark.slow
def test_ctrl_c_saves_the_step_and_the_resume_is_bit_exact(uninterrupted, tmp_path):
    out = tmp_path / "run"
    stopped = launch(RESUME_ARGS + ["--out_dir", str(out)], fault="ctrl_c_in_step:3", check=False)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "Ctrl-C: the run stops after this step and saves it" in stopped.stderr
    assert "interrupted (Ctrl-C): checkpoint saved at step 3; continue with --resume latest" in stopped.stdout
    assert saved_steps(out) == [2, 3] and not (out / "final").exists()
    resumed = launch(RESUME_ARGS + ["--out_dir", str(out), "--resume", "latest"])
    assert_same_weights(uninterrupted, out)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    last = read_metrics(out)[-1]  # the end of a run: its last evaluations' scores and what to run next
    assert (f"validation loss {last['val_loss']:.4f}, HellaSwag acc {last['hellaswag_acc']:.4f}, HellaSwag acc_norm "
            f"{last['hellaswag_acc_norm']:.4f} at step 6; next: python -m model.sample --model {out}") in resumed.stdout


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_keeping_the_last_checkpoint(uninterrupted, tmp_path):
    out = tmp_path / "run"
    stopped = launch(RESUME_ARGS + ["--out_dir", str(out)], fault="ctrl_c_twice_in_step:4", check=False)
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        "error: interrupted (Ctrl-C twice): stopped at once; the last saved checkpoint is kept whole, step 2 "
        f"({out / 'checkpoints' / 'step_000002'}); continue with --resume latest") and "Traceback" not in stopped.stderr
    assert saved_steps(out) == [2]  # step 4 never ran: nothing after the last checkpoint was kept or half-written
    assert not list((out / "checkpoints").glob(".tmp-*"))
    launch(RESUME_ARGS + ["--out_dir", str(out), "--resume", "latest"])
    assert_same_weights(uninterrupted, out)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_to_accelerate_launch_on_two_processes_saves_and_resumes_bit_exact(ddp_run, tmp_path):
    out = tmp_path / "run"
    stopped = launch(DDP_ARGS + ["--out_dir", str(out)], nproc=2, fault="ctrl_c_in_step:2", check=False)
    # The launcher re-raises the signal as its own error (status 1) after the workers saved and exited 0.
    assert "continue with --resume latest" in stopped.stdout, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert "exitcode  : 2" not in stopped.stderr
    last = saved_steps(out)[-1]
    assert 2 <= last < 4 and not (out / "final").exists()  # both ranks stopped after the same step
    launch(DDP_ARGS + ["--out_dir", str(out), "--resume", "latest"], nproc=2)
    assert_same_weights(ddp_run, out)


def test_a_second_ctrl_c_says_what_the_run_kept(tmp_path, monkeypatch, capsys):
    """The second Ctrl-C's one line (in this process: the flag as train.py makes it, two real SIGINTs, run_cli) says
    what was kept and how to go on; it said only `error: interrupted`.

    It names the newest complete checkpoint, never a save it cut short; before any save, how to start over. The run's
    real line: `test_a_second_ctrl_c_stops_at_once_keeping_the_last_checkpoint`.

    Seen to catch: `PreemptionFlag` raising a bare KeyboardInterrupt again: `error: interrupted` instead of the line."""
    from common.errors import run_cli
    from common.run_dir import RunDir
    from training.preemption import PreemptionFlag, what_was_kept

    run = RunDir(tmp_path / "run")
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # the flag wraps both streams: put them back afterwards
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}

    def ctrl_c_twice() -> None:
        PreemptionFlag(announce=False, kept=partial(what_was_kept, run))
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the second Ctrl-C did not stop the run")

    def line() -> str:
        with pytest.raises(SystemExit) as exit_info:
            run_cli(ctrl_c_twice)
        assert exit_info.value.code == 2
        return capsys.readouterr().err.strip()

    try:
        assert line() == ("error: interrupted (Ctrl-C twice): stopped at once; no checkpoint was saved yet; "
                          f"--resume latest --out_dir {run.path} starts the run over")
        run.checkpoint(4).mkdir(parents=True)
        (run.checkpoint(4) / "gpt_config.json").write_text("{}")
        (run.checkpoint(6)).mkdir()  # a save the Ctrl-C cut short: never published, not named
        assert line() == ("error: interrupted (Ctrl-C twice): stopped at once; the last saved checkpoint is kept "
                          f"whole, step 4 ({run.checkpoint(4)}); continue with --resume latest")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
