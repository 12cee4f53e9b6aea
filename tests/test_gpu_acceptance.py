"""benchmarks/gpu_acceptance.py --smoke: the GPU acceptance command runs its every stage on the CPU, so it never
rots."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

STAGES = ["env", "tests", "step_compile", "train_resume", "fsdp", "hellaswag", "step_eager", "memory_plan"]
STEP_FIGURES = ["accelerate_tokens_per_s", "bare_tokens_per_s", "accelerate_over_bare", "accelerate_mfu",
                "accelerate_peak_mem_gib", "bare_peak_mem_gib", "optimizer_fused", "tf32_matmul",
                "accelerate_last_loss"]


def acceptance(out: Path, *args: str, module: bool = False) -> subprocess.CompletedProcess:
    entry = ["-m", "benchmarks.gpu_acceptance"] if module else [str(REPO_ROOT / "benchmarks" / "gpu_acceptance.py")]
    # Started from another folder: the script form must not depend on the working directory.
    return subprocess.run([sys.executable, *entry, "--smoke", "--out", str(out), *args], cwd=REPO_ROOT if module
                          else out.parent, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("acceptance") / "acc"
    return out, acceptance(out)


@pytest.mark.slow
def test_smoke_run_reports_every_stage_with_its_figures(smoke):
    out, proc = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "acceptance.json").read_text())
    assert report["smoke"] is True
    stages = report["stages"]
    assert list(stages) == STAGES
    assert {n: r["status"] for n, r in stages.items()} == {**{n: "pass" for n in STAGES}, "fsdp": "skipped",
                                                           "memory_plan": "skipped"}
    assert "FSDP needs an accelerator" in stages["fsdp"]["figures"]["skip_reason"]

    assert stages["env"]["figures"]["torch"] and stages["env"]["figures"]["cuda_available"] is False
    assert stages["tests"]["figures"]["passed"] >= 5 and stages["tests"]["figures"]["failed"] == 0
    for name in ("step_compile", "step_eager"):
        figures = stages[name]["figures"]
        assert set(STEP_FIGURES) <= set(figures), name
        assert figures["accelerate_tokens_per_s"] > 0 and figures["bare_tokens_per_s"] > 0
        assert figures["mixed_precision"] == "bf16" and figures["model"] == "tiny"
        assert figures["accelerate_last_loss"] == pytest.approx(figures["bare_last_loss"], rel=1e-3)
    train = stages["train_resume"]["figures"]
    assert train["killed_exit_code"] != 0 and train["checkpoint_at_kill"] == "step_000002"
    assert train["resumed"] is True and train["precision"] == "bf16" and train["distributed"] == "NO"
    assert "model.safetensors" in train["final_files"] and train["tok_per_sec"] > 0 and train["val_loss"] > 0
    hellaswag = stages["hellaswag"]["figures"]
    assert hellaswag["items"] == 7 and hellaswag["best_seconds"] > 0 and hellaswag["seconds_batch4"] > 0

    table = (out / "acceptance.md").read_text()
    for name in STAGES:
        assert f"| {name} | {stages[name]['status']}" in table
    assert not (out / "work").exists()  # the runs' folders went to a temporary folder, now removed


@pytest.mark.slow
def test_a_failing_stage_is_reported_and_earlier_results_are_kept(smoke):
    out, _ = smoke
    proc = acceptance(out, "--stages", "hellaswag", "--hellaswag_data", str(out / "missing.jsonl"))
    assert proc.returncode == 1
    stages = json.loads((out / "acceptance.json").read_text())["stages"]
    assert stages["hellaswag"]["status"] == "fail"
    assert "missing.jsonl" in stages["hellaswag"]["output_tail"]
    assert stages["train_resume"]["status"] == "pass"  # from the first call, kept in the merged report
    assert "| hellaswag | fail" in (out / "acceptance.md").read_text()


def test_module_form_and_unknown_stages(tmp_path):
    proc = acceptance(tmp_path / "acc", "--stages", "fsdp,memory_plan", module=True)
    assert proc.returncode == 0, proc.stderr
    stages = json.loads((tmp_path / "acc" / "acceptance.json").read_text())["stages"]
    assert stages["fsdp"]["status"] == "skipped" and stages["memory_plan"]["status"] == "skipped"
    assert "needs a GPU" in stages["memory_plan"]["figures"]["skip_reason"]
    proc = acceptance(tmp_path / "acc", "--stages", "fsdp,nonsense")
    assert proc.returncode == 2 and "nonsense" in proc.stderr
