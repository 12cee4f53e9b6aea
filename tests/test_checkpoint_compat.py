"""A checkpoint written by an older version of train.py still resumes under today's code.

The older version is a pinned commit of this repository (`OLD`, the main branch before the configuration was
split into groups and checkpoints recorded their optimizers by name), extracted with `git archive` and run
as it was: its own train.py leaves checkpoints in the old format; today's train.py resumes a copy of that run from
its checkpoint of step 2 (conftest.resume_copy). The reference is the old code's own uninterrupted run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest
from conftest import REPO_ROOT, assert_weights_within_rounding, launch, read_metrics, resume_copy

OLD = "77d78a9"  # main at the start of the redesign (issue 22)
ARGS = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--val_tokens", "256",
        "--eval_batch_size", "4", "--sample_tokens", "4", "--lr", "3e-3", "--warmup_steps", "2", "--max_steps", "4",
        "--micro_batch_size", "2", "--total_batch_size", "128", "--save_every", "2", "--log_every", "1",
        "--eval_every", "1000", "--dropout", "0.1",  # dropout: the restored RNG streams matter
        # the defaults of OLD's time, which issue 55 changed: a resume passes the recorded recipe
        "--beta2", "0.95", "--muon_momentum", "0.95"]


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory) -> Path:
    """The repository as it was at commit OLD."""
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", "--format=tar", OLD], capture_output=True)
    assert archive.returncode == 0, (f"commit {OLD} is not in this clone ({archive.stderr.decode().strip()}); "
                                     "the test needs the repository's history (a full git clone)")
    tree = tmp_path_factory.mktemp("old") / "repo"
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def run(tree: Path, args: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRAD_ACCUM": "1"}
    env.pop("FAULT", None)
    if fault:
        env["FAULT"] = fault
    return subprocess.run([sys.executable, str(tree / "tests" / "fault_train.py"), *args], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_checkpoint_of_the_old_format_resumes(old_tree, tmp_path, optimizer):
    """A checkpoint written by the code before the redesign (commit 77d78a9; AdamW and Muon; a copy of the old code's
    run resumed from its step 2) resumes under today's code; AdamW ends at the old code's own uninterrupted weights.

    Seen to catch: the old optimizer count 2 no longer read as ("adamw", "muon"): the Muon case is refused as
    damaged."""
    args = ARGS + ["--optimizer", optimizer]
    reference = run(old_tree, args + ["--out_dir", str(tmp_path / "reference")])  # the old code, uninterrupted
    assert reference.returncode == 0, reference.stderr[-3000:]
    state = json.loads((tmp_path / "reference" / "checkpoints" / "step_000002" / "run_state.json").read_text())
    assert state["optimizers"] == {"adamw": 1, "muon": 2}[optimizer]  # the old format: a count, not names

    out = tmp_path / "run"
    resumed = launch(args + resume_copy(tmp_path / "reference", 2, out))  # today's train.py, from the old step 2
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} at step 2" in resumed.stdout
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    if optimizer == "adamw":
        # The weights, optimizer moments, RNG streams and data position were all taken up (the learning rate's
        # arithmetic was regrouped since, so agreement with the old code's own run is to float rounding).
        assert_weights_within_rounding(tmp_path / "reference", out)
