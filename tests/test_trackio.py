"""`--report_to trackio`: a run's numbers in trackio's local SQLite (no account, no Hub), the same as metrics.jsonl, a
resume continuing the same trackio run, trackio not installed as one line; its dashboard in a headless browser
(benchmarks/trackio_view.py) where chromium is installed."""
from __future__ import annotations

import sys

import pytest
from conftest import TINY, read_metrics, run_in_process, train_in_process

from training.metrics import tracker_run_name

RUN_ARGS = TINY + ["--micro_batch_size", "2", "--total_batch_size", "64", "--save_every", "2", "--log_every", "1",
                   "--eval_every", "2", "--report_to", "trackio"]


def trackio_logs(project: str, run: str) -> list[dict]:
    """What trackio's own storage holds for a run: one row per logged step, with its metrics."""
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(project, run)


def trackio_runs(project: str) -> list[str]:
    import trackio

    return [run.name for run in trackio.Api().runs(project)]


@pytest.mark.slow  # two tiny runs in this process: about 10 s
def test_a_run_and_its_resume_log_one_trackio_run_equal_to_metrics_jsonl(tmp_path):
    """`--report_to trackio`: trackio's own storage (`SQLiteStorage.get_logs`, offline, the session's `$TRACKIO_DIR`)
    holds the run's loss and validation loss, the same floats as metrics.jsonl, and a resume continues the same trackio
    run (one run, named `<folder>-<run id>`). The run's output holds its `trackio show --project` line without terminal
    codes.

    Seen to catch: trackio's `"resume": "allow"` turned to `"never"` in `training/run_folder.py`: two trackio runs.
    `init_trackers` outside `trackers_in_plain_text`: the output holds ESC[ codes."""
    pytest.importorskip("trackio", reason="trackio is not installed (pip install -e \".[trackio]\")")
    out, project = tmp_path / "run", f"test-{tmp_path.name}"  # a project (one SQLite file) of this test's own
    args = RUN_ARGS + ["--out_dir", str(out), "--wandb_project", project]
    first, _ = train_in_process(args + ["--max_steps", "2"])
    train_in_process(args + ["--max_steps", "4", "--resume", "latest"])
    # trackio's banner, into a log: its lines without their colour codes (issue 55: ESC[1m ESC[38;5;208m in the log)
    assert f'trackio show --project "{project}"' in first and "\x1b[" not in first
    run_id = (out / "checkpoints" / "step_000004" / "run_state.json").read_text()
    (name,) = trackio_runs(project)  # the resume continued the run: one run, named with the run's id
    assert name.startswith("run-") and name.removeprefix("run-") in run_id
    logged = {row["step"]: row for row in trackio_logs(project, name) if "loss" in row}
    expected = read_metrics(out)
    assert sorted(logged) == [row["step"] for row in expected if "loss" in row] == [1, 2, 3, 4]
    for row in expected:
        assert logged[row["step"]]["loss"] == row["loss"]  # the same float, stored as JSON by both
        if "val_loss" in row:
            assert any(r.get("val_loss") == row["val_loss"] for r in trackio_logs(project, name))


def test_the_trackers_banner_reaches_a_log_without_terminal_codes(monkeypatch, capsys):
    """What trackio prints when it starts (its colour codes: ESC[1m ESC[38;5;208m ... ESC[0m) reaches a log or a
    pipe as plain text; a terminal gets it as it is.

    Seen to catch: `init_trackers` outside `trackers_in_plain_text`: the slow run test finds ESC[ codes in the run's
    output."""
    from training.metrics import trackers_in_plain_text

    banner = '* View dashboard by running in your terminal:\n\x1b[1m\x1b[38;5;208mtrackio show --project "p"\x1b[0m\n'
    with trackers_in_plain_text():
        print(banner, end="")
    assert capsys.readouterr().out == '* View dashboard by running in your terminal:\ntrackio show --project "p"\n'
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    with trackers_in_plain_text():
        print(banner, end="")
    assert capsys.readouterr().out == banner


def test_the_trackio_run_is_named_by_the_run_and_its_id(tmp_path):
    from common.run_dir import RunDir

    assert tracker_run_name(None, RunDir(tmp_path / "shakespeare"), "1a2b3c4d") == "shakespeare-1a2b3c4d"
    assert tracker_run_name("mine", RunDir(tmp_path / "shakespeare"), "1a2b3c4d") == "mine-1a2b3c4d"


def test_report_to_trackio_without_trackio_is_one_line(tmp_path, monkeypatch, capsys):
    """`--report_to trackio` without trackio installed is one line naming the install, exit 2, nothing written.

    Seen to catch: the `find_spec` check off: accelerate's `import trackio` fails with a ModuleNotFoundError
    traceback."""
    monkeypatch.setitem(sys.modules, "trackio", None)  # what a machine without the package finds
    err = run_in_process(monkeypatch, capsys, TINY + ["--out_dir", str(tmp_path / "run"), "--report_to", "trackio"])
    assert err == ("error: --report_to trackio needs trackio, which is not installed; pip install -e \".[trackio]\" "
                   "(or pip install trackio), or choose another --report_to")
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.slow  # a 60-step run, the dashboard served, chromium twice: about 40 s on 2 cores
def test_the_dashboard_shows_the_runs_loss_in_a_headless_browser(tmp_path):
    """trackio's dashboard, served on 127.0.0.1 and drawn by a headless chromium, lists the run and draws its loss and
    validation loss (`python -m benchmarks.trackio_view`; skipped, with its reason, where chromium is not installed).

    Seen to catch: the dashboard's metric filter set to a metric that does not exist: 0 plots instead of 2. The
    screenshot itself (docs/trackio_dashboard.png; chromium 156, trackio 0.43.0) was looked at: the loss from 10.8 to
    6.5 over 60 steps, the validation loss at steps 20, 40 and 60."""
    pytest.importorskip("trackio", reason="trackio is not installed (pip install -e \".[trackio]\")")
    from benchmarks.trackio_view import find_chromium, look, train

    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no chromium on this machine (apt-get install chromium): the dashboard cannot be looked at")
    out, project, shot = tmp_path / "view", f"test-{tmp_path.name}", tmp_path / "dashboard.png"
    train(out, project)
    _page, dom = look(project, shot, chromium)
    (name,) = trackio_runs(project)
    assert name.startswith("view-") and name in dom  # the run is listed ...
    assert dom.count("<canvas") == 2  # ... with its two plots drawn: loss and val_loss (their look: the docstring)
    assert shot.stat().st_size > 0
