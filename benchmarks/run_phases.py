"""train.py itself, with the peak memory of each phase of its run recorded: the probe of `benchmarks.bench_run_memory`.

    python -m benchmarks.run_phases REPORT_DIR [train.py's flags]
    accelerate launch --multi_gpu --num_processes 2 -m benchmarks.run_phases REPORT_DIR [train.py's flags]

It imports train.py as a module, wraps the calls that begin and end each phase (the names train.py and
training.evaluations.runner call them by, in `PHASES`), and runs `train.main` as `python train.py` would. Each rank
writes
`REPORT_DIR/rank{r}.json`: {phase: peak bytes} and the whole process's.

On a CPU a phase's peak is the resident set (RSS): the kernel's high-water mark (VmHWM) when the phase raised it,
which is then exact; else the largest of a sample taken every `SAMPLE_S` seconds by a thread (a lower bound: the
phase stayed under an earlier one's peak). The whole process's is VmHWM at its end: what `/usr/bin/time -f %M`
says. On CUDA each phase starts from `torch.cuda.reset_peak_memory_stats` and its peak is
`torch.cuda.max_memory_allocated`: the tensors' bytes, exact. Phases do not nest: the health check that a
checkpoint save runs (a one-window validation loss) counts to the save. Time outside every phase (setup, the log
line, shutdown) is the phase "other".
"""
from __future__ import annotations

import functools
import json
import os
import sys
import threading
from pathlib import Path

import torch

SAMPLE_S = 0.002
# Each phase, the objects whose attribute, called, is that phase: each looked up in its module when it is called, or
# imported by train.py's `train` once its flags are parsed, after these are wrapped.
PHASES = {
    "step": ("training.step", "train_step"),
    "validation": ("eval.val_loss", "evaluate_loss"),  # imported by validation's score when it runs
    "sample": ("training.evaluations.validation", "sample"),
    "hellaswag": ("eval.hellaswag", "evaluate_hellaswag"),
    "checkpoint save": ("training.checkpoints.checkpoint", "Checkpointer.save"),
    "export": ("training.checkpoints.export", "export_final"),
}
OTHER = "other"


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


class PhaseMeter:
    """Peak memory per phase of this process (see the module docstring)."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self.current = OTHER
        self._lock = threading.Lock()
        self._hwm_at_start = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        threading.Thread(target=self._sample, daemon=True, name="rss-sampler").start()

    @staticmethod
    def cuda() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def _rss(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self._page

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            rss = self._rss()
            with self._lock:
                if rss > self.peaks.get(self.current, 0):
                    self.peaks[self.current] = rss

    def _close(self, phase: str) -> None:
        if self.cuda():
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            hwm = _status_bytes("VmHWM")
            # Raised here: exact; else the samples' largest, or the RSS now for a phase too short to be sampled.
            peak = hwm if hwm > self._hwm_at_start else self._rss()
            self._hwm_at_start = hwm
        with self._lock:
            self.peaks[phase] = max(self.peaks.get(phase, 0), peak)

    def switch(self, phase: str) -> str:
        """Close the current phase, begin `phase`; returns the one closed."""
        closed = self.current
        self._close(closed)
        with self._lock:
            self.current = phase
        return closed

    def wrap(self, phase: str, fn):
        @functools.wraps(fn)
        def in_phase(*args, **kwargs):
            if self.current != OTHER:  # nested (the save's health check): the outer phase's
                return fn(*args, **kwargs)
            self.switch(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.switch(OTHER)
        return in_phase

    def report(self) -> dict:
        self.switch(OTHER)
        self._stop.set()
        # VmHWM; a sample can read a few pages more (the kernel's per-thread RSS counters are folded in lazily).
        whole = max(self.peaks.values()) if self.cuda() else max(_status_bytes("VmHWM"), *self.peaks.values())
        return {"device": "cuda" if self.cuda() else "cpu", "phases": dict(self.peaks), "whole": whole}


def install(meter: PhaseMeter) -> None:
    """Wrap each phase's call (see PHASES); an AttributeError names a phase whose call train.py no longer makes."""
    import importlib

    for phase, (module_name, path) in PHASES.items():
        owner = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        setattr(owner, name, meter.wrap(phase, getattr(owner, name)))


def main() -> None:
    report_dir, train_args = Path(sys.argv[1]), sys.argv[2:]
    sys.argv = ["train.py", *train_args]
    meter = PhaseMeter()
    install(meter)  # imports train.py (its main sets the CPU allocator, as `python train.py` does)
    import train
    from common.errors import run_cli

    try:
        run_cli(train.main)
    finally:
        rank = int(os.environ.get("RANK", "0"))
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / f"rank{rank}.json").write_text(json.dumps(meter.report(), indent=1))


if __name__ == "__main__":
    main()
