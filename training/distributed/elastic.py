"""A launch that heals itself: restarts by torch's elastic agent, and a bound on how long a rank waits for the others.

Under `accelerate launch --max_restarts N ... --resume latest`, torch's elastic agent restarts the whole group when
a worker dies, up to N times. Each attempt resumes from the newest complete checkpoint (docs/faults.md). The workers'
side of it:

- `Attempt`: which attempt this is, for the run's header.
- `process_group_settings`: the group's timeout (`--collective_timeout`), and a store prefix per attempt.
- `PeerWatch`: a peer that died or hung becomes one line; an error that repeats after a restart stops the launch.
"""
from __future__ import annotations

import functools
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from common.errors import UserError, fail, print_error
from training.distributed.engines import requested_engine
from training.distributed.processes import process_state


@dataclass(frozen=True)
class Attempt:
    """This launch attempt: `restart` (0 for the first) of at most `max_restarts` restarts."""

    restart: int = 0
    max_restarts: int = 0

    @classmethod
    def of_launch(cls) -> Attempt:
        """From torch's elastic agent's environment; without an agent, the first and only attempt."""
        return cls(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                   int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0))

    def describe(self) -> str | None:
        """`restart k of N` for a launch that may restart (k = 0 at first); None for one that may not."""
        return f"restart {self.restart} of {self.max_restarts}" if self.max_restarts else None


def _under_agent_store() -> bool:
    """Whether torch's elastic agent serves this launch's store (torchrun / accelerate launch of several processes)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("WORLD_SIZE", "1")) > 1


@functools.cache
def _agent_store(timeout_s: int) -> torch.distributed.Store:
    """A client of the elastic agent's TCPStore (node 0's agent serves it for the whole launch, across restarts)."""
    return torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                      int(os.environ["WORLD_SIZE"]), is_master=False,
                                      timeout=timedelta(seconds=timeout_s))


def process_group_settings(timeout_s: int) -> dict[str, Any]:
    """The keyword arguments of `torch.distributed.init_process_group` for this launch, for accelerate's
    PartialState. A collective that waits longer than `timeout_s` seconds for a rank fails.

    Under the elastic agent the group rendezvouses through node 0's agent store under `attempt_<k>/`. The agent keeps
    one store for the whole launch, and the workers write their addresses under the same keys at every attempt.
    Without the prefix a restarted rank could read a dead peer's address and fail to connect. Elsewhere the group
    opens as accelerate opens it, from MASTER_ADDR/MASTER_PORT. DeepSpeed opens its group itself and takes no store."""
    settings: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if _under_agent_store() and requested_engine() != "deepspeed":
        store = torch.distributed.PrefixStore(f"attempt_{Attempt.of_launch().restart}/", _agent_store(timeout_s))
        settings.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return settings


def open_process_group(timeout_s: int, latest_checkpoint: Callable[[], Path | None]) -> PeerWatch:
    """Open the launch's process group and return the `PeerWatch` to enter around the rest of the run.
    `latest_checkpoint()` gives the newest complete checkpoint, for the line."""
    state = process_state(**process_group_settings(timeout_s))
    return PeerWatch(state.process_index, state.num_processes, timeout_s, latest_checkpoint)


# What gloo (and NCCL) say when a collective fails because a peer is gone or silent. A collective that fails for
# another reason (a shape mismatch: a bug) keeps its traceback.
_TIMED_OUT = ("Timed out waiting", "timed out", "Timeout", "timeout")
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe",
              "Connection refused", "Socket closed", "NCCL communicator was aborted", "remote process exited")
# How long a rank that saw a collective fail waits for the roll call. The survivors of one failure see it within about
# a second of each other, since all wait in the same collective.
ROLL_CALL_S = 5.0


def lost_peer(err: BaseException) -> str | None:
    """'timeout' or 'gone' when `err` is a collective failing because a peer stopped answering; None otherwise."""
    if not isinstance(err, RuntimeError):
        return None
    text = str(err)
    if any(marker in text for marker in _PEER_GONE):
        return "gone"
    if any(marker in text for marker in _TIMED_OUT):
        return "timeout"
    return None


class PeerWatch:
    """Turns a collective that failed because a peer died or hung into one line, and records this rank's own errors
    for the others and the next attempt. Enter it around the rest of the run once the group is open;
    `follow(progress)` gives it the step to name."""

    def __init__(self, rank: int, world_size: int, timeout_s: int, latest_checkpoint: Callable[[], Path | None],
                 attempt: Attempt | None = None) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.latest_checkpoint = latest_checkpoint
        self.attempt = attempt or Attempt.of_launch()
        self.store = _agent_store(timeout_s) if _under_agent_store() and world_size > 1 else None
        self.progress: Any = None  # training.checkpoints.resume.Progress, once the run knows where it starts

    def follow(self, progress: Any) -> None:
        """Name `progress.step` (the last completed step) in the line from now on."""
        self.progress = progress

    def _key(self, what: str, attempt: int | None = None) -> str:
        return f"gpt2_accelerate/attempt_{self.attempt.restart if attempt is None else attempt}/{what}"

    def __enter__(self) -> PeerWatch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, err: BaseException | None, tb: object) -> None:
        if not isinstance(err, Exception):  # none, or a SystemExit / KeyboardInterrupt: the run's own ending
            return
        if self.world_size > 1 and (how := lost_peer(err)) is not None:
            self._report(how, self.progress.step if self.progress is not None else 0)
        else:
            self._record(err)

    def _record(self, err: Exception) -> None:
        """Tell the other ranks and the next attempt that this rank stops on its own error, so the survivors stay
        quiet. If the attempt before ended on the same error, restarting does not help: the agent gets SIGTERM (it
        stops its workers and exits 1) and the line says so. A deterministic error would otherwise use up every
        restart."""
        if self.store is None:
            return
        message = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}"
        previous = self._key("error", self.attempt.restart - 1)
        try:
            self.store.set(self._key("error"), message)
            again = (self.attempt.restart > 0 and self.store.check([previous])
                     and self.store.get(previous).decode() == message)
            # One signal per agent (a node's processes share it): the first of its ranks to get here sends it.
            stop = (again and self.attempt.restart < self.attempt.max_restarts
                    and self.store.add(self._key(f"stop/{os.environ.get('GROUP_RANK', '0')}"), 1) == 1)
        except (RuntimeError, OSError):  # the store's server (node 0's agent) is gone: nothing to tell
            return
        if again:
            note = f"again after restart {self.attempt.restart}: restarting does not help, so the launch stops here"
            if isinstance(err, UserError):
                err.args = (f"{message} ({note})",)
            else:
                print_error(f"(rank {self.rank}) {message} ({note})")
        if stop:
            os.kill(os.getppid(), signal.SIGTERM)  # our parent is the elastic agent

    def _report(self, how: str, step: int) -> None:
        """A peer died or hung: a roll call in the store finds which, and one survivor prints the line. Every survivor
        exits with status 2."""
        silent: list[int] | None = None
        own_error = False
        if self.store is not None:
            try:
                self.store.set(self._key(f"answered/{self.rank}"), str(step))
                time.sleep(ROLL_CALL_S)
                answered = [r for r in range(self.world_size) if self.store.check([self._key(f"answered/{r}")])]
                silent = [r for r in range(self.world_size) if r not in answered]
                own_error = self.store.check([self._key("error")])
                reporter = min(answered)
            except (RuntimeError, OSError, ValueError):
                silent, reporter = None, self.rank
        else:
            reporter = self.rank
        if own_error or reporter != self.rank:
            fail("", quiet=True)  # the rank with the error printed it, or another survivor prints the line
        raise UserError(self.describe(how, step, silent))

    def describe(self, how: str, step: int, silent: list[int] | None) -> str:
        """The line of a run whose peers stopped answering after `step`, the last step every rank completed."""
        who = (f"process{'es' if len(silent) > 1 else ''} {', '.join(str(r) for r in silent)}" if silent
               else "another process")
        what = (f"did not answer for {self.timeout_s} s (--collective_timeout)" if how == "timeout"
                else "stopped (its connection closed: the process died or was killed)")
        latest = self.latest_checkpoint()
        kept = (f"the last checkpoint is {latest}" if latest is not None else "the run has no checkpoint yet")
        if self.attempt.restart < self.attempt.max_restarts:
            after = f"the launcher restarts the run ({self.attempt.restart + 1} of {self.attempt.max_restarts})"
        else:
            after = "continue with --resume latest"
        return f"{who} {what} after step {step}; {kept}: {after}"
