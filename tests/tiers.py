"""The two tiers of the suite, and the check that keeps the quick one quick (docs/testing.md, "Tiers").

A test marked `slow` runs in the whole suite only; every other test is in the quick tier, `-m "not slow"`, the one
an edit loop runs (at most 4 minutes on 2 quiet cores). What makes a test slow is mostly what it starts: a Python
process pays 4-5 s of imports (torch, accelerate) before it does anything, a multi-process launch several times
that. So:
- a test not marked `slow` that starts a process, in its body or through its fixtures, fails, naming the command
  (git excepted: `conftest.project_files` asks it for the file list, in milliseconds);
- a test marked `multiprocess` and not `slow` is refused when the suite is collected;
- the quick tests that took longer than QUICK_SECONDS are listed at the end of the run, as candidates for the mark
  (a list, not a failure: a busy machine is no reason to fail a test).

In the quick tier the check is exact: nothing slow ran before, so every process a quick test needs is its own. In
the whole suite, a session fixture a slow test built first starts nothing for the quick test that reads it later:
the check can miss there, never fail wrongly, so CI runs the quick tier as a pass of its own (.ci/run).

The hooks are conftest.py's (it imports them); `pytest -p tiers` loads them into any other session (their test).
"""
from __future__ import annotations

import os
import subprocess

import pytest

QUICK_SECONDS = 5.0  # setup + call of a quick test, on 2 quiet cores; longer ones are listed at the end
NOT_COUNTED = frozenset({"git"})

_running: list[pytest.Item] = []  # the test being set up, run or torn down (an inner session's on top)
_started: dict[str, list[str]] = {}  # nodeid -> the commands of the processes it started
_setup_seconds: dict[str, float] = {}
_slow_quick_tests: list[tuple[float, str]] = []


def _command(args) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        return str(os.fsdecode(args)).split()
    return [str(os.fsdecode(a)) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in args]


def _counted(command: list[str]) -> bool:
    return bool(command) and os.path.basename(command[0]) not in NOT_COUNTED


def pytest_configure(config: pytest.Config) -> None:
    original = subprocess.Popen.__init__

    def recording_init(self, args, *rest, **kwargs):
        command = _command(args)
        if _running and _counted(command) and not getattr(self, "_tiers_counted", False):  # once (nested sessions)
            self._tiers_counted = True
            _started.setdefault(_running[-1].nodeid, []).append(" ".join(command)[:160])
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = recording_init
    config.add_cleanup(lambda: setattr(subprocess.Popen, "__init__", original))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items
                if item.get_closest_marker("multiprocess") and not item.get_closest_marker("slow")]
    if unmarked:
        raise pytest.UsageError(f"marked multiprocess but not slow (the quick tier starts no process): {unmarked}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _running.append(item)
    _started.pop(item.nodeid, None)
    try:
        yield
    finally:
        _running.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    commands = _started.get(item.nodeid)
    if report.when == "call" and report.passed and commands and not item.get_closest_marker("slow"):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} is in the quick tier but started {len(commands)} process(es), first: "
                           f"{commands[0]!r}; mark it @pytest.mark.slow (tests/tiers.py)")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Setup's and call's seconds of each quick test (under pytest-xdist these reports reach the controller, in the
    order a worker ran them)."""
    if "slow" in report.keywords:
        return
    if report.when == "setup":
        _setup_seconds[report.nodeid] = report.duration
    elif report.when == "call":
        seconds = _setup_seconds.pop(report.nodeid, 0.0) + report.duration
        if seconds > QUICK_SECONDS:
            _slow_quick_tests.append((seconds, report.nodeid))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _slow_quick_tests:
        return
    terminalreporter.section("quick tests slower than the quick tier allows")
    terminalreporter.write_line(f"over {QUICK_SECONDS:g} s (setup + call) without @pytest.mark.slow; mark them, or "
                                "make them quicker:")
    for seconds, nodeid in sorted(_slow_quick_tests, reverse=True):
        terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
