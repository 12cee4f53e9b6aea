"""What a launch says before train.py trains: the user's own command lines, through accelerate's real launcher
where the claim is about its output (marked slow), in process where the claim is about train.py's answer.

A core install (no DeepSpeed) is simulated by tests/core_install/ on PYTHONPATH (its sitecustomize hides the
installed DeepSpeed from every process of the launch, the launcher's too).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, TINY

CORE_INSTALL = str(REPO_ROOT / "tests" / "core_install")
CONFIGS = REPO_ROOT / "accelerate_configs"


def _core_install_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (CORE_INSTALL, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


# accelerate's launcher (accelerate/commands/launch.py, deepspeed_launcher) checks for DeepSpeed before it starts any
# process, and its ImportError is the last line the user reads.
ACCELERATES_LINE = "ImportError: DeepSpeed is not installed => run `pip3 install deepspeed` or build it from source."


@pytest.mark.slow
def test_a_zero_config_on_a_core_install_stops_in_accelerates_launcher_before_train_py(tmp_path):
    """The README's claim for a ZeRO config without DeepSpeed: accelerate's launcher stops it, exit 1, its last line
    naming the install, and train.py never starts (no run folder). No config of ours can reach train.py first: a
    DEEPSPEED config always goes through that check, and only it tells the processes their ZeRO settings."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "zero2_8gpu.yaml"),
         "train.py", *TINY, "--max_steps", "2", "--out_dir", str(out)],
        cwd=REPO_ROOT, env=_core_install_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ACCELERATES_LINE
    assert not out.exists()


@pytest.mark.slow
def test_a_deepspeed_process_on_a_core_install_is_one_line(tmp_path):
    """A process told by its environment that it runs under DeepSpeed (a launcher other than accelerate's, such as
    torchrun with accelerate's variables set by hand) on a core install: train.py's one line, not accelerate's
    traceback from inside the Accelerator."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", *TINY, "--max_steps", "2", "--out_dir", str(out)],
                          cwd=REPO_ROOT, env=_core_install_env(ACCELERATE_USE_DEEPSPEED="true"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        'error: the accelerate config asks for DeepSpeed, which is not installed; pip install -e ".[deepspeed]" '
        "(or use a DDP or FSDP config)"]
    assert not out.exists()
