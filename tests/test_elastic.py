"""A run that heals itself (issue 35): one worker of two (gloo) dies, hangs or fails alone, under `accelerate launch
--max_restarts N` with `--resume latest` in the command (docs/faults.md, "A worker dies or hangs").

Each case against the uninterrupted two-process run: a killed worker's group restarts and ends bit-identical to it,
each step logged once in metrics.jsonl and TensorBoard; a hung worker ends the run within --collective_timeout (+
the agent's 30 s) in one line naming a whole checkpoint; an error of one rank alone stops after the first restart
(a bug's crash too, its traceback kept); a worker killed more often than the restarts allow leaves the last
checkpoint intact. A restarted rank 1 starts 3 s late (tests/fault_train.py), so that the other rank always reaches
the rendezvous first: the order in which a restart used to read the dead rank's address
(training/distributed/elastic.py).
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import TINY, assert_same_weights, launch, read_metrics

# 8 steps of 2 processes x accumulation 2, a checkpoint at 3 and 6, an evaluation at 4 and 8, dropout (so that a
# lost RNG state would change the weights), a TensorBoard log.
STEPS = 8
ARGS = TINY + ["--max_steps", str(STEPS), "--micro_batch_size", "2", "--total_batch_size", "256", "--save_every",
               "3", "--log_every", "1", "--eval_every", "4", "--dropout", "0.1", "--lr", "1e-3",
               "--report_to", "tensorboard", "--resume", "latest"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("elastic") / "run"
    launch(ARGS + ["--out_dir", str(out)], nproc=2)
    return out


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def tensorboard_steps(out: Path, tag: str = "loss") -> list[int]:
    """The steps TensorBoard shows for `tag`, across every event file of the run (as its UI reads them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = {p.parent for p in out.glob("tensorboard/*/events.out.tfevents.*")}  # tensorboard/<project>/
    assert len(folder) == 1, folder
    events = EventAccumulator(str(folder.pop()))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def assert_each_step_once(out: Path, reference: Path) -> None:
    assert [r["step"] for r in read_metrics(out)] == [r["step"] for r in read_metrics(reference)]
    assert tensorboard_steps(out) == list(range(1, STEPS + 1))


def assert_no_worker_traceback(output: str) -> None:
    assert "[rank0]: Traceback" not in output and "[rank1]: Traceback" not in output, output[-5000:]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", ["kill_rank_1_after_step:5", "kill_rank_1_in_save:6", "kill_rank_1_in_eval"])
def test_a_killed_worker_restarts_and_the_run_ends_as_if_uninterrupted(reference, tmp_path, fault):
    """SIGKILL to rank 1 between checkpoints (after step 5), while the checkpoint of step 6 is written (never
    published: the restart resumes step 3), or inside the evaluation after step 4: the survivor prints one line, the
    agent restarts both ranks (restart 1 of 1), they resume from step 3 and end bit-identical to the uninterrupted
    run, each step once in metrics.jsonl and TensorBoard.

    The restarted rank 1 starts 3 s late, the order that lost the race.

    TensorBoard shows each step once after a restart (`tensorboard_steps`, read with TensorBoard's own
    EventAccumulator).

    Seen to catch: the attempt's key prefix removed (the group through env:// and the agent's store, as before): exit 1,
    the restarted rank 0's `Gloo connectFullMesh failed ... Connection refused` to the dead rank 1's old port, no
    restart left. `purge_step` removed: TensorBoard shows steps 1, 2, 3, 4, 5, 4, 5, 6, 7, 8."""
    out = tmp_path / "run"
    proc = launch(ARGS + ["--out_dir", str(out)], nproc=2, fault=fault, launcher_args=("--max_restarts", "1"))
    output = proc.stdout + proc.stderr
    assert "restart 0 of 1" in output and "restart 1 of 1" in output
    assert f"resumed from {out / 'checkpoints' / 'step_000003'} at step 3" in output
    lost = "error: process 1 stopped (its connection closed: the process died or was killed) after step "
    assert len(error_lines(output)) == 1 and error_lines(output)[0].startswith(lost), output[-5000:]
    assert error_lines(output)[0].endswith(f"the last checkpoint is {out / 'checkpoints' / 'step_000003'}: the "
                                           "launcher restarts the run (1 of 1)")
    assert_no_worker_traceback(output)
    assert_same_weights(reference, out)
    assert_each_step_once(out, reference)
    assert not list(out.rglob(".tmp-*"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_hung_worker_ends_the_run_within_the_timeout_in_one_line_naming_a_whole_checkpoint(tmp_path):
    """SIGSTOP to rank 1 after step 5, --collective_timeout 10: rank 0 gives up waiting after 10 s and names the
    step, the rank and the last checkpoint in one line; the agent ends the stopped rank (SIGKILL, 30 s after its
    SIGTERM); all within the timeout + 60 s of the stop. The checkpoint it names is whole (its manifest verifies):
    what a resume from it gives is the kill tests' claim (a killed worker's run, below, resumes it).

    Seen to catch: the timeout not passed (gloo's 30 minutes): still running 70 s after step 5."""
    from training.checkpoints.resume import find_resume_point, verify_checkpoint

    out = tmp_path / "run"
    proc = launch(ARGS + ["--out_dir", str(out), "--collective_timeout", "10"], nproc=2,
                  fault="stop_rank_1_after_step:5", background=True)
    try:
        while not (out / "metrics.jsonl").exists() or len(read_metrics(out)) < 5:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        stopped = time.monotonic()
        output = proc.communicate(timeout=10 + 60)[0]  # the bound of issue 35 (raises TimeoutExpired past it)
        print(f"ended {time.monotonic() - stopped:.0f} s after step 5 was logged")
    finally:
        if proc.poll() is None:  # past the bound: the launcher's agent ends its workers (SIGKILL after 30 s)
            proc.terminate()
            proc.wait(timeout=60)
    assert proc.returncode != 0
    assert error_lines(output) == [f"error: process 1 did not answer for 10 s (--collective_timeout) after step 5; the "
                                   f"last checkpoint is {out / 'checkpoints' / 'step_000003'}: continue with --resume "
                                   "latest"], output[-5000:]
    assert_no_worker_traceback(output)
    verify_checkpoint(find_resume_point("latest", out))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("max_restarts", [0, 3])
def test_an_error_of_one_rank_is_one_line_and_stops_after_the_first_restart(tmp_path, max_restarts):
    """A UserError on rank 1 alone as step 6 begins, in every attempt (deterministic): its line, and nothing from
    rank 0 (no traceback, no second line). With --max_restarts 3 the group restarts once, meets the same error, says
    so and stops the launch instead of using up the other two restarts.

    Seen to catch: the agent not told to stop: the same line after restarts 1, 2 and 3, every restart used."""
    out = tmp_path / "run"
    proc = launch(ARGS + ["--out_dir", str(out)], nproc=2, fault="error_on_rank_1_at_step:5", check=False,
                  launcher_args=("--max_restarts", str(max_restarts)))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert_no_worker_traceback(output)
    message = "error: (rank 1) an error of rank 1 alone at step 6"
    if max_restarts == 0:
        assert error_lines(output) == [message], output[-5000:]
        # the agent's failure report names rank 1's line as its root cause (common.errors.tell_the_elastic_agent)
        root = output.split("Root Cause (first observed failure):")[-1].splitlines()
        assert "  rank      : 1 (local_rank: 1)" in root and f"  traceback : {message}" in root, output[-3000:]
        return
    assert error_lines(output) == [message, f"{message} (again after restart 1: restarting does not help, so the "
                                            "launch stops here)"], output[-5000:]
    assert "restart 1 of 3" in output and "restart 2 of 3" not in output


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_crash_of_one_rank_keeps_its_traceback_and_stops_after_the_first_restart(tmp_path):
    """A RuntimeError (a bug, not a UserError) on rank 1 alone as step 6 begins, in every attempt, --max_restarts 3:
    its traceback in each of the two attempts, nothing from rank 0, and after the restart one line saying that the
    same error came again and the launch stops (it does not use up the other two restarts).

    Seen to catch: only UserErrors recorded (as before): rank 0's lost-peer line at every attempt, "the launcher
    restarts the run (2 of 3)", every restart used."""
    out = tmp_path / "run"
    proc = launch(ARGS + ["--out_dir", str(out)], nproc=2, fault="crash_on_rank_1_at_step:5", check=False,
                  launcher_args=("--max_restarts", "3"))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert output.count("RuntimeError: a crash of rank 1 alone at step 6") >= 2, output[-5000:]
    assert "[rank0]: Traceback" not in output, output[-5000:]
    assert error_lines(output) == ["error: (rank 1) RuntimeError: a crash of rank 1 alone at step 6 (again after "
                                   "restart 1: restarting does not help, so the launch stops here)"], output[-5000:]
    assert "restart 1 of 3" in output and "restart 2 of 3" not in output


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_worker_killed_more_often_than_the_restarts_allow_leaves_the_last_checkpoint_intact(tmp_path):
    """Rank 1 killed after step 5 in every attempt, --max_restarts 1: the agent gives up after the restart (exit
    status 1), and the checkpoint of step 3, the only one, is whole (its manifest verifies): what a resume from it
    gives is the killed-worker cases' claim (each resumes step 3 and ends bit-identical).

    Seen to catch: not broken on purpose (a new test)."""
    from training.checkpoints.resume import find_resume_point, verify_checkpoint

    out = tmp_path / "run"
    proc = launch(ARGS + ["--out_dir", str(out)], nproc=2, fault="kill_rank_1_every_attempt:5", check=False,
                  launcher_args=("--max_restarts", "1"))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "restart 1 of 1" in output
    assert error_lines(output)[-1].endswith(f"the last checkpoint is {out / 'checkpoints' / 'step_000003'}: "
                                            "continue with --resume latest"), output[-5000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000003"]
    verify_checkpoint(find_resume_point("latest", out))


def test_the_line_names_the_silent_ranks_the_step_and_what_happens_next(tmp_path):
    """The survivors' line names the silent ranks, the step, the checkpoint and what happens next; it also decides which
    collective errors count as a lost peer.

    Seen to catch: not broken on purpose (a new test)."""
    from training.distributed.elastic import Attempt, PeerWatch, lost_peer

    checkpoint = tmp_path / "checkpoints" / "step_000003"
    watch = PeerWatch(0, 4, 10, lambda: checkpoint, Attempt(restart=0, max_restarts=2))
    assert watch.describe("timeout", 5, [1, 3]) == (f"processes 1, 3 did not answer for 10 s (--collective_timeout) "
                                                    f"after step 5; the last checkpoint is {checkpoint}: the launcher "
                                                    "restarts the run (1 of 2)")
    watch = PeerWatch(0, 2, 10, lambda: None, Attempt())
    assert watch.describe("gone", 0, None) == ("another process stopped (its connection closed: the process died or "
                                               "was killed) after step 0; the run has no checkpoint yet: continue "
                                               "with --resume latest")
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:45706. This is ...")
    timed_out = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation")
    assert [lost_peer(e) for e in (closed, timed_out, RuntimeError("shape mismatch"), ValueError("x"))] == \
        ["gone", "timeout", None, None]
