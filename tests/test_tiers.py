"""The tiers' check (tests/tiers.py), in a small pytest session of its own run in this process: a quick test that
starts a process fails naming it, in its body or through a fixture; marked slow it passes; git is not counted; a
multiprocess mark without the slow one is refused at collection.

Quick tests over 5 s are listed at the end of the run.

Seen to catch: the recording in `tests/tiers.py` replaced by `pass`:
`test_a_quick_test_that_starts_a_process_fails_naming_it` fails. Its first run over the suite flagged 25 quick tests
that started Python processes; they are marked slow."""
from __future__ import annotations

from pathlib import Path

import pytest

TESTS = '''
import subprocess, sys
import pytest

@pytest.fixture
def a_run():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_quick_starting_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_quick_through_a_fixture(a_run):
    pass

@pytest.mark.slow
def test_slow_starting_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_quick_asking_git():
    subprocess.run(["git", "--version"], check=True, capture_output=True)

def test_quick_starting_nothing():
    assert True
'''


class Outcomes:
    """A plugin for the inner session: each test's outcome and, for a failure, its message."""

    def __init__(self) -> None:
        self.outcomes: dict[str, tuple[str, str]] = {}

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.failed:
            self.outcomes[report.nodeid.split("::")[-1]] = (report.outcome, str(report.longrepr or ""))


def run_session(folder: Path, source: str) -> tuple[int, Outcomes]:
    (folder / f"test_inner_{folder.name}.py").write_text(source)  # a module name no earlier session imported
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n    multiprocess: several processes\n")
    outcomes = Outcomes()
    code = pytest.main(["-q", "-p", "tiers", "-p", "no:cacheprovider", "-p", "no:xdist", "--import-mode=importlib",
                        "-W", "ignore::pytest.PytestAssertRewriteWarning", str(folder)], plugins=[outcomes])
    return code, outcomes


def test_a_quick_test_that_starts_a_process_fails_naming_it(tmp_path, capsys):
    code, result = run_session(tmp_path, TESTS)
    capsys.readouterr()  # the inner session's report
    outcomes = result.outcomes
    assert code == 1
    for name in ("test_quick_starting_python", "test_quick_through_a_fixture"):
        status, message = outcomes[name]
        assert status == "failed" and "is in the quick tier but started 1 process(es)" in message, (name, message)
        assert "mark it @pytest.mark.slow" in message and "-c pass" in message
    for name in ("test_slow_starting_python", "test_quick_asking_git", "test_quick_starting_nothing"):
        assert outcomes[name][0] == "passed", (name, outcomes[name])


def test_a_multiprocess_mark_without_the_slow_one_is_refused_at_collection(tmp_path, capsys):
    code, _ = run_session(tmp_path, "import pytest\n\n@pytest.mark.multiprocess\ndef test_two():\n    pass\n")
    assert code == pytest.ExitCode.USAGE_ERROR
    assert "marked multiprocess but not slow" in capsys.readouterr().err


GROUPING_CONFTEST = '''
import importlib.util, sys
sys.path.insert(0, {tests!r})
spec = importlib.util.spec_from_file_location("project_conftest", {conftest!r})
project = importlib.util.module_from_spec(spec)
spec.loader.exec_module(project)
pytest_collection_modifyitems = project.pytest_collection_modifyitems  # the project's rule, tryfirst included
'''

GROUPED_TESTS = '''
import os, pytest

@pytest.fixture(scope="module")
def built_once(tmp_path_factory):
    with open({log!r}, "a") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"] + "\\\\n")

@pytest.mark.parametrize("i", range(6))
def test_uses_the_module_fixture(built_once, i):
    pass

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    pass
'''


@pytest.mark.slow
def test_loadgroup_keeps_a_module_fixtures_tests_on_one_worker(tmp_path):
    """conftest.py's groups under the README's `-n 2 --dist loadgroup`, with the pytest and pytest-xdist installed:
    the tests that use a module-scoped fixture run on one worker, which builds it once. pytest-xdist 3.8 drops the
    groups without a word under pytest 9.2 (pyproject.toml pins pytest below it), as it did while this conftest's
    hook ran after xdist's: each worker then built the fixture (the two-node SLURM job, the elastic reference)."""
    import subprocess
    import sys

    from conftest import REPO_ROOT

    log = tmp_path / "built.log"
    (tmp_path / "conftest.py").write_text(GROUPING_CONFTEST.format(tests=str(REPO_ROOT / "tests"),
                                                                   conftest=str(REPO_ROOT / "tests" / "conftest.py")))
    (tmp_path / "test_grouped.py").write_text(GROUPED_TESTS.format(log=str(log)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup", "-p",
                           "no:cacheprovider", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    grouped = [line for line in proc.stdout.splitlines() if "PASSED" in line and "test_uses_the_module_fixture" in line]
    assert len(grouped) == 6 and all(line.rstrip().endswith("@test_grouped.py") for line in grouped), grouped
    assert len(log.read_text().split()) == 1  # built once, by the one worker that ran them all


SPENDING_TESTS = '''
import subprocess, sys, time

def busy(seconds):
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass

def test_spends_in_a_process():
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\n"
                    "while time.process_time() - t < 0.6: pass"], check=True)

def test_spends_here():
    busy(0.3)

def test_spends_nothing():
    pass
'''

COSTS_CONFTEST = '''
import sys
sys.path.insert(0, {tests!r})
import cpu_costs

def pytest_configure(config):
    config.pluginmanager.register(cpu_costs.CpuCosts(), "cpu_costs")
'''


@pytest.mark.slow
def test_each_tests_cpu_seconds_reach_the_report_from_the_workers(tmp_path):
    """tests/cpu_costs.py under `-n 2 --durations=2` (CI's form): the two tests that cost the most CPU-seconds are
    listed, a process the test waited for counted in its test (>= the 0.6 s its loop spent) and a test's own work in
    its own (>= 0.3 s), the one that spent nothing left out. Busy loops on CPU time, so a busy machine cannot
    shorten them.

    Seen to catch: the cost kept on the worker (the teardown report's `user_properties` not given it): no list."""
    import re
    import subprocess
    import sys

    from conftest import REPO_ROOT

    (tmp_path / "conftest.py").write_text(COSTS_CONFTEST.format(tests=str(REPO_ROOT / "tests")))
    (tmp_path / "test_spending.py").write_text(SPENDING_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--durations=2", "-p", "no:cacheprovider",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    listed = {name: float(seconds) for seconds, name in
              re.findall(r"^\s*([\d.]+) CPU-s  test_spending\.py::(\w+)$", proc.stdout, re.M)}
    assert set(listed) == {"test_spends_in_a_process", "test_spends_here"}, proc.stdout[-3000:]
    assert listed["test_spends_in_a_process"] >= 0.6 and listed["test_spends_here"] >= 0.3, listed
    assert "CPU-s over 3 tests" in proc.stdout
