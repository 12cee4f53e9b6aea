"""Stopping a run without losing it: SIGTERM / SIGUSR1 (a cluster's preemption) and the first Ctrl-C (SIGINT)
become a flag the loop checks after each step, so every rank checkpoints at the same step and the run exits
cleanly, ready for `--resume latest`. A second Ctrl-C stops at once (KeyboardInterrupt, whose one line says what
was kept): what was saved stays, a save it interrupts was never published (checkpoints are renamed into place whole).

Under `accelerate launch` a terminal's Ctrl-C reaches the launcher only: the workers run in sessions of their own.
torch's elastic agent forwards it to every worker once, and kills them 30 s later. The step and the save must fit
in that time, or the run resumes from the checkpoint before.

A scheduler signals the whole job, so whatever reads our output (`| tee log`) usually dies first. After a signal,
output that can no longer be written is dropped, rather than raising `BrokenPipeError` and losing the checkpoint.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Callable, TextIO

from accelerate import Accelerator

from common.run_dir import RunDir, checkpoint_step
from training.distributed.processes import any_rank


def what_was_kept(run: RunDir) -> str:
    """What a run stopped at once (a second Ctrl-C) has kept, and how to go on: its newest complete checkpoint."""
    newest = run.latest_checkpoint()
    if newest is None:
        return f"no checkpoint was saved yet; --resume latest --out_dir {run.path} starts the run over"
    return (f"the last saved checkpoint is kept whole, step {checkpoint_step(newest)} ({newest}); continue with "
            "--resume latest")


class PreemptionFlag:
    """Records SIGTERM/SIGUSR1/SIGINT from the moment it is created (handlers are installed then, not at import).
    `announce`: say on stderr, at the first Ctrl-C, what happens next (one process of a launch says it); `kept`:
    what the run has kept when a second Ctrl-C stops it at once (the KeyboardInterrupt's message, which `run_cli`
    prints as the run's one line).

    It puts `sys.stdout`/`sys.stderr` behind `_DropAfterSignal`, so create it before anything that keeps a reference
    to them (a tqdm bar does)."""

    def __init__(self, announce: bool = True, kept: Callable[[], str] | None = None) -> None:
        self.signal: int | None = None
        self.announce = announce
        self.kept = kept
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)
        if sys.stdout is not None and not isinstance(sys.stdout, _DropAfterSignal):
            sys.stdout = _DropAfterSignal(sys.stdout, self)
        if sys.stderr is not None and not isinstance(sys.stderr, _DropAfterSignal):
            sys.stderr = _DropAfterSignal(sys.stderr, self)

    def _handle(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT:
            if self.signal == signal.SIGINT:  # the second Ctrl-C: stop now, as Python's own handler would
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt(self.stopped_at_once())
            if self.announce:
                print("\nCtrl-C: the run stops after this step and saves it (Ctrl-C again stops at once, keeping the "
                      "last saved checkpoint)", file=sys.stderr, flush=True)
        self.signal = signum

    def stopped_at_once(self) -> str:
        """The line of a run that a second Ctrl-C stopped, saying what it kept."""
        return "interrupted (Ctrl-C twice): stopped at once" + (f"; {self.kept()}" if self.kept else "")

    def received(self) -> bool:
        return self.signal is not None

    def stopped_at(self, step: int, last: bool = False) -> str:
        """What the run says when it stops on a signal, after saving the checkpoint of `step`. On the `last` step the
        run has finished: it goes on to write final/, and there is nothing to continue."""
        what = "interrupted (Ctrl-C)" if self.signal == signal.SIGINT else "signal received"
        if last:
            return (f"{what} on the last step: checkpoint saved at step {step}, the run is finished and writes final/ "
                    "now (should this be cut short, --resume latest writes it)")
        return f"{what}: checkpoint saved at step {step}; continue with --resume latest"

    def any_rank(self, accelerator: Accelerator) -> bool:
        """True on every rank if a signal reached any rank, so all stop at the same step. Does not wait for the
        device."""
        return any_rank(self.signal is not None, accelerator)


class _DropAfterSignal:
    """A text stream that, once a preemption signal has arrived, drops what it cannot write.

    Before a signal every error is raised as usual: a dead log is not ours to hide then. After one, the first failed
    write points the stream's file descriptor at /dev/null. Later writes from anywhere (C code, tqdm, the interpreter
    at exit, which would otherwise exit 120) then go nowhere instead of failing.
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
        # A method call, not an attribute read, so that Python runs a pending signal handler first: the signal that
        # killed our reader may have arrived during the failed write.
        if not self._flag.received():
            raise error
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # no file descriptor behind it (a StringIO): just drop
            pass

    def __getattr__(self, name: str) -> object:  # encoding, isatty, fileno, ... of the real stream
        if name == "_stream":  # not set yet (made without __init__, e.g. by copy): no recursion
            raise AttributeError(name)
        return getattr(self._stream, name)
