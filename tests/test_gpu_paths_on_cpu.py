"""The paths GPU users launch, run on this CPU machine as far as they can be: bf16 autocast with
torch.compile (inductor) on two processes, and an exact resume in bf16.

What only a GPU shows (CUDA kernels, fused AdamW, TF32, FSDP2 sharding, speed) is measured by
`python benchmarks/gpu_acceptance.py` in a session that has one; see docs/benchmarks.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import (
    DDP_ARGS,
    REPO_ROOT,
    RESUME_ARGS,
    assert_same_weights,
    final_weights,
    free_port,
    launch,
    read_metrics,
    resume_copy,
)

BF16 = {"ACCELERATE_MIXED_PRECISION": "bf16"}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bf16_inductor_on_two_processes_trains_evaluates_checkpoints_and_exports(ddp_run, tmp_path):
    """2 processes x accumulation 2, bf16 autocast, inductor: no recompilation after the first step (not per
    micro-step, not for the DDP no-sync steps, not for the evaluations, which run on the plain module),
    validation loss close to the fp32 run's, a checkpoint and a plain-keyed final export.

    Seen to catch: evaluations run on the compiled module (`keep_torch_compile=True`): dynamo's recompile log
    appears."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--mixed_precision", "bf16", "--dynamo_backend", "inductor", "--main_process_port", str(free_port()),
           "train.py", *DDP_ARGS, "--out_dir", str(out)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "TORCH_LOGS": "recompiles"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "precision: bf16 | torch.compile (inductor)" in proc.stdout
    assert "Recompiling" not in proc.stderr, [line for line in proc.stderr.splitlines() if "ecompil" in line]
    ours, fp32 = read_metrics(out)[-1]["val_loss"], read_metrics(ddp_run)[-1]["val_loss"]
    assert abs(ours - fp32) < 0.02, (ours, fp32)
    assert json.loads((out / "checkpoints" / "step_000004" / "run_state.json").read_text())["world_size"] == 2
    weights = final_weights(out)
    assert not any("_orig_mod" in k for k in weights)
    assert weights.keys() == final_weights(ddp_run).keys()


@pytest.mark.slow
def test_a_bf16_run_resumes_bit_exact(tmp_path):
    """bf16 autocast keeps fp32 weights and optimizer state: the run resumed from its own checkpoint of step 2 ends
    bit-identical.

    Seen to catch: not broken on purpose (a new test)."""
    reference, out = tmp_path / "ref", tmp_path / "run"
    launch(RESUME_ARGS + ["--out_dir", str(reference)], extra_env=BF16)
    resumed = launch(RESUME_ARGS + resume_copy(reference, 2, out), extra_env=BF16)
    assert "precision: bf16" in resumed.stdout
    assert_same_weights(reference, out)
