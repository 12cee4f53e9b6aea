"""What each test costs the suite in CPU-seconds, listed beside `--durations=N` (the N that cost the most).

On CI's 2 cores the slow tier is CPU-bound: its 3 workers and the processes they start keep both cores busy
nearly all the time (1,850-2,120 CPU-s in a 950-1,090 s pass, 2026-11-28). A test's wall time then says how busy
the machine was while it ran; its CPU-seconds say what it costs the suite, and what cutting it would save.

A test's CPU-seconds: its worker's own (in-process runs) plus those of the processes it waited for (a launch
counts its workers). A session fixture's build counts for the first test that asks for it. A process killed and
never waited for is not counted.
"""
from __future__ import annotations

import resource

import pytest

PROPERTY = "cpu_s"  # the name on each test's teardown report, which carries it to xdist's controller


def cpu_seconds() -> float:
    """User and system CPU-seconds of this process and of every process it has waited for."""
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


class CpuCosts:
    """The plugin (conftest.py registers one per session): measured where the tests run, listed where they are
    reported (under pytest-xdist, a worker and the controller)."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}  # nodeid -> this process's CPU-seconds when its setup began
        self.costs: dict[str, float] = {}  # nodeid -> CPU-seconds of setup, call and teardown, as reported

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        self.started[item.nodeid] = cpu_seconds()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        outcome = yield
        if call.when == "teardown" and item.nodeid in self.started:
            spent = cpu_seconds() - self.started.pop(item.nodeid)
            outcome.get_result().user_properties.append((PROPERTY, spent))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "teardown":
            self.costs.update((report.nodeid, value) for name, value in report.user_properties if name == PROPERTY)

    def pytest_terminal_summary(self, terminalreporter, exitstatus: int, config: pytest.Config) -> None:
        shown = config.getoption("durations", None)
        if shown is None or not self.costs:
            return
        costliest = sorted(self.costs.items(), key=lambda cost: cost[1], reverse=True)[:shown or None]
        terminalreporter.section(f"costliest {len(costliest)} tests in CPU-seconds (tests/cpu_costs.py)")
        terminalreporter.write_line(f"{sum(self.costs.values()):.0f} CPU-s over {len(self.costs)} tests; each: its "
                                    "worker's and the processes it waited for")
        for nodeid, seconds in costliest:
            terminalreporter.write_line(f"{seconds:7.1f} CPU-s  {nodeid}")
