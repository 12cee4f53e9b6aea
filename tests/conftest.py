"""Shared test setup: everything runs offline, on the CPU, with the repo root importable."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

# Set before any test imports transformers/datasets/wandb: nothing may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
# The repo's packages, and the scripted ranks of the distributed evaluation tests (tests/fixtures/eval/fake_ranks.py).
for folder in (REPO_ROOT, REPO_ROOT / "tests" / "fixtures" / "eval"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def free_port() -> int:
    """A loopback port nobody listens on, for the rendezvous of a multi-process test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
