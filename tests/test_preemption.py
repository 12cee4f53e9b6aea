"""Preemption as clusters deliver it: SIGTERM while the log pipe dies, SIGTERM to `accelerate launch`.

The plain case (SIGTERM to a single train.py) is tests/test_train.py::test_sigterm_saves_and_exits_cleanly.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO_ROOT, TINY, free_port, read_metrics

ARGS = TINY + ["--max_steps", "400", "--micro_batch_size", "2", "--total_batch_size", "128", "--save_every", "1000",
               "--log_every", "1", "--eval_every", "1000"]


def env() -> dict[str, str]:
    """As a job script runs it: stdout block-buffered into the pipe, so the interpreter flushes it at exit."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "OMP_NUM_THREADS": "1"}


def wait_for_a_logged_step(out: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not (out / "metrics.jsonl").exists() or not read_metrics(out):
        assert proc.poll() is None, f"exited {proc.returncode} before its first step"
        assert time.time() < deadline, "no step logged in time"
        time.sleep(0.2)


def saved_steps(out: Path) -> list[int]:
    return [json.loads(p.read_text())["step"] for p in sorted((out / "checkpoints").glob("step_*/run_state.json"))]


@pytest.mark.slow
def test_sigterm_through_a_dying_pipe_still_checkpoints(tmp_path):
    """`python train.py ... 2>&1 | tee log` in a job script, SIGTERM to the process group: tee dies at once,
    train.py's next progress-bar write meets a closed pipe. The checkpoint must still be written, exit 0."""
    out = tmp_path / "run"
    tee = subprocess.Popen(["tee", str(tmp_path / "log")], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    train = subprocess.Popen([sys.executable, "train.py", *ARGS, "--out_dir", str(out)], cwd=REPO_ROOT, env=env(),
                             stdout=tee.stdin, stderr=subprocess.STDOUT, start_new_session=True)
    tee.stdin.close()  # train.py holds the only write end: the pipe is dead once tee is
    try:
        wait_for_a_logged_step(out, train)
        os.kill(tee.pid, signal.SIGTERM)  # what a scheduler's SIGTERM to the job's process group does
        os.kill(train.pid, signal.SIGTERM)
        assert train.wait(timeout=120) == 0
    finally:
        for proc in (train, tee):
            if proc.poll() is None:
                proc.kill()
    assert tee.wait() == -signal.SIGTERM
    assert 1 <= saved_steps(out)[-1] < 400
    assert "signal received" not in (tmp_path / "log").read_text()  # written after tee died, dropped


@pytest.mark.slow
def test_sigterm_on_the_last_step_finishes_the_run_and_says_so(tmp_path):
    """A preemption signal that lands on the run's last step: the checkpoint of that step is saved, final/ is written
    and the line says the run is finished. Seen to catch (issue 60): "signal received: checkpoint saved at step 2;
    continue with --resume latest" for a run that then wrote final/ (a resume would train nothing)."""
    from conftest import launch

    out = tmp_path / "run"
    proc = launch(TINY + ["--max_steps", "2", "--micro_batch_size", "2", "--total_batch_size", "128", "--out_dir",
                          str(out)], fault="sigterm_in_step:2")
    assert ("signal received on the last step: checkpoint saved at step 2, the run is finished and writes final/ now"
            in proc.stdout), proc.stdout
    assert "continue with --resume latest" not in proc.stdout + proc.stderr
    assert saved_steps(out) == [2] and (out / "final" / "model.safetensors").is_file()


def test_after_a_signal_a_dead_stream_is_pointed_at_devnull():
    """The in-loop half of the test above, plus what it cannot see: after the first failed write, the file
    descriptor is /dev/null, so writers holding the original stream (the interpreter's flush at exit, a
    logging handler made at import) no longer fail either."""
    from training.preemption import PreemptionFlag, _DropAfterSignal

    flag = PreemptionFlag.__new__(PreemptionFlag)  # no handlers installed in the pytest process
    flag.signal = None
    read_end, write_end = os.pipe()
    raw = open(write_end, "w")
    stream = _DropAfterSignal(raw, flag)
    os.close(read_end)
    with pytest.raises(BrokenPipeError):  # before a signal a dead log is an error like any other
        stream.write("x")
        stream.flush()
    flag.signal = signal.SIGTERM
    stream.write("y")
    stream.flush()
    raw.write("z")
    raw.flush()
    raw.close()


# ---- SIGTERM to `accelerate launch` -----------------------------------------------------------------------

# The job-script pattern of docs/faults.md: the script's trap hands the signal to the launcher's children
# (the training processes), which checkpoint and exit 0; the launcher then exits 0 like after any finished run.
JOB_SCRIPT = """
{launch} &
launcher=$!
trap 'pkill -TERM -P "$launcher"' TERM USR1
wait "$launcher"  # a trapped signal ends this wait early...
wait "$launcher"  # ...this one returns the launcher's own exit status
"""


def accelerate_launch(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO_ROOT / "accelerate_configs" / "cpu_2proc.yaml"), "--main_process_port", str(free_port()),
            "train.py", *args]


def signal_after_step(proc: subprocess.Popen, out: Path, step: int, pid: int) -> str:
    """Send SIGTERM to `pid` once a step beyond `step` is logged; return the run's output."""
    deadline = time.time() + 180
    while not (out / "metrics.jsonl").exists() or not read_metrics(out) or read_metrics(out)[-1]["step"] <= step:
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "no step logged in time"
        time.sleep(0.2)
    os.kill(pid, signal.SIGTERM)
    return proc.communicate(timeout=180)[0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_the_launcher_checkpoints_and_the_job_script_pattern_exits_0(tmp_path):
    out = tmp_path / "run"
    args = ARGS + ["--total_batch_size", "256", "--out_dir", str(out)]
    popen = dict(cwd=REPO_ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                 start_new_session=True)

    # SIGTERM to the launcher itself: torch's elastic agent forwards it to the workers, which checkpoint and
    # exit 0, then re-raises it as SignalException: the launcher's status is 1 whatever the workers did.
    launcher = subprocess.Popen(accelerate_launch(args), **popen)
    output = signal_after_step(launcher, out, 0, launcher.pid)
    assert launcher.returncode == 1, output
    assert "SignalException" in output and "continue with --resume latest" in output
    first = saved_steps(out)[-1]
    assert first >= 1

    # Resumed under the documented job script, SIGTERM to the script: the workers save, everything exits 0.
    job = subprocess.Popen(["bash", "-c", JOB_SCRIPT.format(launch=shlex.join(accelerate_launch(
        args + ["--resume", "latest"])))], **popen)
    output = signal_after_step(job, out, first, job.pid)
    assert job.returncode == 0, output
    assert f"resumed from {out / 'checkpoints' / f'step_{first:06d}'}" in output
    assert saved_steps(out)[-1] > first
