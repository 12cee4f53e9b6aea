"""Cluster preemption: SIGTERM / SIGUSR1 become a flag the loop checks after each step, so every rank
checkpoints at the same step and the run exits cleanly, ready for `--resume latest`."""
from __future__ import annotations

import signal

import torch
from accelerate import Accelerator


class PreemptionFlag:
    """Records SIGTERM/SIGUSR1 from the moment it is created (handlers are installed then, not at import)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.signal = signum

    def any_rank(self, accelerator: Accelerator) -> bool:
        """True on every rank if a signal reached any rank (so all ranks stop at the same step)."""
        flag = torch.tensor([0.0 if self.signal is None else 1.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)
