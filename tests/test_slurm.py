"""accelerate_configs/slurm.sbatch on two "nodes" on localhost, with SLURM faked: no SLURM install needed.

The sbatch script runs as SLURM would run it (bash, SLURM_* in the environment). `srun` and `scontrol` are
small stand-ins put first on PATH: the fake srun starts one task per node with SLURM_NODEID 0/1, each in its
own process group, and forwards a signal it gets to each task's whole process group (what slurmstepd does,
so the node script and its `accelerate launch` both get it; the training processes run in their own
sessions); the fake scontrol resolves the node list and records `requeue` calls. Both nodes rendezvous on
127.0.0.1 and write into the same --out_dir (a shared filesystem).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    DDP_ARGS,
    REPO_ROOT,
    assert_same_weights,
    assert_weights_within_rounding,
    free_port,
    launch,
    read_metrics,
)

FAKE_SRUN = r"""#!/bin/bash
# srun --nodes N --ntasks-per-node 1 [--kill-on-bad-exit=1] CMD...: one task per node, here all on localhost
while [[ $1 == --* ]]; do case $1 in --nodes|--ntasks-per-node) shift 2 ;; *) shift ;; esac; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 setsid "$@" &
    pids+=($!)
done
trap 'for p in "${pids[@]}"; do kill -USR1 -- "-$p" 2>/dev/null; done' USR1
trap 'for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done' TERM
status=0
for node in "${!pids[@]}"; do
    while kill -0 "${pids[$node]}" 2>/dev/null; do wait "${pids[$node]}"; done
    wait "${pids[$node]}"; s=$?
    echo "fake srun: task on node $node exited $s"
    ((s > status)) && status=$s
done
exit "$status"
"""

FAKE_SCONTROL = r"""#!/bin/bash
case "$1 $2" in
    "show hostnames") tr ',' '\n' <<< "$3" ;;
    requeue*) echo "$*" >> "$FAKE_SLURM_LOG" ;;
    *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""

STEPS = 16
# 2 nodes x 1 process x accumulation 2 x micro-batch 2 x 32 tokens = 256 tokens per step
ARGS = DDP_ARGS + ["--max_steps", str(STEPS), "--save_every", "1000", "--eval_every", "1000"]


@pytest.fixture(scope="module")
def fake_slurm(tmp_path_factory) -> Path:
    bin_dir = tmp_path_factory.mktemp("fake_slurm_bin")
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    # The CPU config with multinode_2x8.yaml's 16 processes: the job must take its count from SLURM's
    # (SLURM_GPUS_ON_NODE=1 x 2 nodes), as it does on a cluster whose nodes have fewer GPUs than the config
    config = (REPO_ROOT / "accelerate_configs" / "cpu_2proc.yaml").read_text()
    assert "\nnum_processes: 2\n" in config
    (bin_dir / "cpu_nodes.yaml").write_text(config.replace("\nnum_processes: 2\n", "\nnum_processes: 16\n"))
    return bin_dir


def sbatch(fake_slurm: Path, log: Path, args: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """`sbatch --nodes 2 --gpus-per-node 1 accelerate_configs/slurm.sbatch ARGS` as the job would run on CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MAIN_", "PYTHONUNBUFFERED"))}
    env.update({
        "PATH": os.pathsep.join([str(fake_slurm), str(Path(sys.executable).parent), env["PATH"]]),
        "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "localhost,localhost",
        "SLURM_GPUS_ON_NODE": "1", "SLURM_SUBMIT_DIR": str(REPO_ROOT), "FAKE_SLURM_LOG": str(log),
        "ACCELERATE_CONFIG": str(fake_slurm / "cpu_nodes.yaml"), "ACCELERATE_USE_CPU": "1",
        "MAIN_PORT": str(free_port()), "OMP_NUM_THREADS": "1", **(extra_env or {}),
    })
    return subprocess.Popen(["bash", str(REPO_ROOT / "accelerate_configs" / "slurm.sbatch"), *args], cwd="/",
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(job: subprocess.Popen) -> str:
    try:
        return job.communicate(timeout=300)[0]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def assert_node0_wrote_the_log(out: Path, steps: range) -> None:
    """Both nodes share --out_dir; only global rank 0 writes the run's files (one line per step, not two)."""
    assert [m["step"] for m in read_metrics(out) if "loss" in m] == list(steps)


@pytest.fixture(scope="module")
def two_node_run(fake_slurm, tmp_path_factory) -> Path:
    """The uninterrupted two-node run, with a tracker and a Hub push: only global rank 0 (node 0) writes the
    tensorboard events and pushes (node 1's local main process is not the main process)."""
    from fake_hub import FakeHub

    tmp = tmp_path_factory.mktemp("slurm")
    out = tmp / "run"
    publish = ["--report_to", "tensorboard", "--push_to_hub", "true", "--hub_model_id", "alice/nodes"]
    with FakeHub() as hub:
        hub_env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_x", "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp / "hf")}
        job = sbatch(fake_slurm, tmp / "scontrol.log", ARGS + ["--out_dir", str(out)] + publish, hub_env)
        output = finish(job)
        assert hub.unknown == []
        pushes = list(hub.commits)
    assert job.returncode == 0, output
    assert [c["repo"] for c in pushes] == ["alice/nodes"], pushes  # one push, not one per node
    events = list((out / "tensorboard").rglob("events.out.tfevents.*"))  # ...tfevents.<time>.<host>.<pid>.<n>
    assert events and len({e.name.split(".")[-2] for e in events}) == 1, events  # written by one process
    for node in (0, 1):
        assert f"node {node} of 2" in output and f"fake srun: task on node {node} exited 0" in output
        assert f"--machine_rank {node} --main_process_ip localhost" in output
    assert "2 process(es) x 2 accumulation" in output
    assert not (tmp / "scontrol.log").exists()  # not signalled: no requeue
    assert_node0_wrote_the_log(out, range(1, STEPS + 1))
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_train_like_one_process(two_node_run, tmp_path):
    """The same global batches on one process (accumulation 4): equal to float rounding (the gradient is
    summed in another order across processes, so not bit for bit; see DDP_ARGS in tests/conftest.py).

    Its config asks for 16 processes, as `multinode_2x8.yaml` does. Only global rank 0 writes metrics, tensorboard
    events and the Hub push (its module fixture).

    Seen to catch: the process count per node not taken from `SLURM_GPUS_ON_NODE` (16 processes: a refused batch).
    `HubUploads` given `is_local_main_process`: the job fails. Before the key-bias bound, this failed on a 2-core
    AVX2-only EPYC (`c_attn.bias` 1.1e-6 apart, every other weight within 2e-8): the key biases' exact gradient is zero,
    so they receive only rounding noise, which depends on the CPU."""
    out = tmp_path / "single"
    launch(ARGS + ["--out_dir", str(out)])
    assert_weights_within_rounding(two_node_run, out)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_usr1_to_the_job_checkpoints_exits_0_requeues_and_resumes_exactly(fake_slurm, two_node_run, tmp_path):
    """--signal=B:USR1@120: SIGUSR1 to the batch script only. Every node checkpoints the same step, every
    process exits 0, the job asks to be requeued; the requeued job (the same script again) resumes with
    --resume latest and ends bit-identical to the uninterrupted two-node run (same processes, same order).

    Seen to catch: the launcher not ignoring SIGUSR1 (both nodes exit 138); the trap in `slurm_node.sh` not forwarding
    to the workers (they train to the end, no checkpoint); `--resume latest` left out (the requeued job is refused:
    "already holds a run"); `REQUEUE` off by default (no `scontrol requeue`)."""
    out, log = tmp_path / "run", tmp_path / "scontrol.log"
    job = sbatch(fake_slurm, log, ARGS + ["--out_dir", str(out)])
    deadline = time.time() + 180
    while not (out / "metrics.jsonl").exists() or not read_metrics(out):
        assert job.poll() is None, finish(job)
        assert time.time() < deadline, "no step logged in time"
        time.sleep(0.1)
    os.kill(job.pid, signal.SIGUSR1)
    output = finish(job)
    assert job.returncode == 0, output
    assert "fake srun: task on node 0 exited 0" in output and "fake srun: task on node 1 exited 0" in output
    assert "after a signal" in output and log.read_text() == "requeue 4242\n"
    saved = [json.loads(p.read_text()) for p in sorted((out / "checkpoints").glob("step_*/run_state.json"))]
    assert len(saved) == 1 and 1 <= saved[0]["step"] < STEPS and saved[0]["world_size"] == 2, output
    assert not (out / "final").exists()

    log.unlink()
    output = finish(job := sbatch(fake_slurm, log, ARGS + ["--out_dir", str(out)]))  # the requeued job
    assert job.returncode == 0, output
    assert f"resumed from {out / 'checkpoints' / 'step_{:06d}'.format(saved[0]['step'])}" in output
    assert not log.exists()
    assert_node0_wrote_the_log(out, range(1, STEPS + 1))
    assert_same_weights(two_node_run, out)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_worker_killed_on_node_1_restarts_both_nodes_and_ends_exactly(fake_slurm, two_node_run, tmp_path):
    """MAX_RESTARTS=1 (slurm_node.sh's `--max_restarts`), rank 1 (node 1's process) SIGKILLed after step 9 of 16,
    a checkpoint every 5: node 1's agent restarts its process, node 0's restarts its own (its collective failed),
    both with restart count 1, so they meet under the same attempt's keys of node 0's store; they resume from step 5
    and end bit-identical to the uninterrupted two-node run, each step logged once, every task exiting 0.

    Seen to catch: `slurm_node.sh` without `--max_restarts`: both nodes' tasks exit 1."""
    out = tmp_path / "run"
    fault = {"MAX_RESTARTS": "1", "FAULT": "kill_rank_1_after_step:9", "TRAIN_SCRIPT": "tests/fault_train.py"}
    output = finish(job := sbatch(fake_slurm, tmp_path / "scontrol.log",
                                  ARGS + ["--out_dir", str(out), "--save_every", "5"], fault))
    assert job.returncode == 0, output
    assert "--max_restarts 1" in output and "restart 1 of 1" in output
    assert f"resumed from {out / 'checkpoints' / 'step_000005'} at step 5" in output
    assert "fake srun: task on node 0 exited 0" in output and "fake srun: task on node 1 exited 0" in output
    assert_node0_wrote_the_log(out, range(1, STEPS + 1))
    assert_same_weights(two_node_run, out)
