"""Cluster preemption: SIGTERM / SIGUSR1 become a flag the loop checks after each step, so every rank
checkpoints at the same step and the run exits cleanly, ready for `--resume latest`.

A scheduler signals the whole job, so whatever reads our output (`| tee log`, a log shipper) usually
dies with us, before us: after a signal, output that can no longer be written is dropped instead of
raising `BrokenPipeError` out of a progress-bar update and losing the checkpoint.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import TextIO

import torch
from accelerate import Accelerator


class PreemptionFlag:
    """Records SIGTERM/SIGUSR1 from the moment it is created (handlers are installed then, not at import).

    It also puts `sys.stdout`/`sys.stderr` behind `_DropAfterSignal`; create it before anything that keeps
    a reference to them (a tqdm bar does)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)
        if sys.stdout is not None and not isinstance(sys.stdout, _DropAfterSignal):
            sys.stdout = _DropAfterSignal(sys.stdout, self)
        if sys.stderr is not None and not isinstance(sys.stderr, _DropAfterSignal):
            sys.stderr = _DropAfterSignal(sys.stderr, self)

    def _handle(self, signum: int, frame: object) -> None:
        self.signal = signum

    def received(self) -> bool:
        return self.signal is not None

    @staticmethod
    def stopped_at(step: int) -> str:
        """What the run says when it stops on a signal, after saving the checkpoint of `step`."""
        return f"signal received: checkpoint saved at step {step}; continue with --resume latest"

    def any_rank(self, accelerator: Accelerator) -> bool:
        """True on every rank if a signal reached any rank (so all ranks stop at the same step)."""
        flag = torch.tensor([0.0 if self.signal is None else 1.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


class _DropAfterSignal:
    """A text stream that, once a preemption signal has arrived, drops what it cannot write.

    Before a signal every error is raised as usual (a dead log is not ours to hide then). After one, the
    first failed write or flush points the stream's file descriptor at /dev/null, so that the later writes
    from anywhere (C code, tqdm's close, the interpreter flushing the original stream at exit, which would
    otherwise print "Exception ignored ... BrokenPipeError" and exit 120) go nowhere instead of failing.
    """

    def __init__(self, stream: TextIO, flag: PreemptionFlag) -> None:
        self._stream = stream
        self._flag = flag

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            self._drop_unless_preempted(error)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            self._drop_unless_preempted(error)

    def _drop_unless_preempted(self, error: OSError) -> None:
        # A method call, not an attribute read: entering it lets Python run a signal handler that is still
        # pending (the signal that killed our reader may have arrived during the failed write).
        if not self._flag.received():
            raise error
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # no file descriptor behind it (pytest's capture, a StringIO): just drop
            pass

    def __getattr__(self, name: str) -> object:  # encoding, isatty, fileno, ... of the real stream
        if name == "_stream":  # not set yet (an instance made without __init__, e.g. by copy): no recursion
            raise AttributeError(name)
        return getattr(self._stream, name)
