"""A run's live view, looked at: train a short run with `--report_to trackio`, serve trackio's dashboard on this
machine (loopback only) and take a screenshot of it in a headless chromium.

    python -m benchmarks.trackio_view                                  # -> trackio_dashboard.png
    python -m benchmarks.trackio_view --screenshot docs/trackio_dashboard.png --out_dir out/trackio_view
    python -m benchmarks.trackio_view --no_train --project gpt2-accelerate   # the runs already in that project

The run is train.py as a user starts it (`python train.py ... --report_to trackio`, a 2-layer GPT on Tiny
Shakespeare, 60 steps: under a minute on 2 cores), into trackio's folder ($TRACKIO_DIR; default
~/.cache/huggingface/trackio). The dashboard is `trackio.show(project)` on 127.0.0.1, showing the loss and the
validation loss; chromium (`apt-get install chromium`, or `--chromium PATH`) renders it with a virtual-time budget
so that the page's scripts draw the plots before the picture is taken. Nothing leaves the machine: no Hub, no
Space, no account. What a user runs to look at their own runs is `trackio show --project <--wandb_project>`
(docs/training.md, "Watching a run").
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlencode

from common.cli import CliParser
from common.errors import UserError, run_cli

# A short run whose loss curve has a shape: 60 steps of a 2-layer GPT, a line every 2 steps, validation every 20.
RUN_FLAGS = ["--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--block_size", "64", "--max_steps", "60",
             "--micro_batch_size", "4", "--total_batch_size", "256", "--log_every", "2", "--eval_every", "20",
             "--val_tokens", "2048", "--sample_tokens", "0", "--save_every", "1000"]
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
WINDOW = "1200,640"
# The plots shown: the training loss and the validation loss (trackio's `metric_filter`, a regular expression).
METRICS = "^(loss|val_loss)$"
# Virtual time chromium gives the page's scripts (fetching the runs, drawing the plots) before the screenshot.
RENDER_BUDGET_MS = 20_000
# Wall-clock limit on chromium itself: the virtual budget runs faster than real time; a hung browser must not hang
# the caller.
CHROMIUM_TIMEOUT_S = 120


def find_chromium(given: str | None = None) -> str | None:
    """The browser to run: `given`, else the first of `CHROMIUM_NAMES` on PATH; None where there is none."""
    if given:
        return shutil.which(given)
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(out_dir: Path, project: str) -> None:
    """The short run, as a user starts it: `python train.py ... --report_to trackio` in its own process."""
    repo = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, str(repo / "train.py"), *RUN_FLAGS, "--out_dir", str(out_dir), "--report_to", "trackio",
           "--wandb_project", project]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"the run into {out_dir} failed (exit {proc.returncode}): "
                        f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")


def look(project: str, path: Path, chromium: str) -> tuple[str, str]:
    """Serve the project's dashboard on 127.0.0.1 and have `chromium` draw it into `path` (a PNG), then dump the
    page it drew; the page's URL and its DOM (a plot is a vega `<canvas>`, beside its title and the runs' names)."""
    import trackio

    app, url, _share, _full = trackio.show(project, open_browser=False, block_thread=False, host="127.0.0.1",
                                            server_port=free_port(), share=False)
    try:
        page = f"{url.rstrip('/')}/?{urlencode({'project': project, 'metric_filter': METRICS})}"
        path.parent.mkdir(parents=True, exist_ok=True)
        browser = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                   f"--window-size={WINDOW}", f"--virtual-time-budget={RENDER_BUDGET_MS}"]
        shot = subprocess.run([*browser, f"--screenshot={path.resolve()}", page], capture_output=True, text=True,
                              timeout=CHROMIUM_TIMEOUT_S)
        if shot.returncode != 0 or not path.is_file():
            raise UserError(f"{chromium} drew no screenshot of {page} (exit {shot.returncode}); run it by hand to "
                            "see why")
        dom = subprocess.run([*browser, "--dump-dom", page], capture_output=True, text=True,
                             timeout=CHROMIUM_TIMEOUT_S)
        return page, dom.stdout
    finally:
        app.close()


def main(argv: list[str] | None = None) -> None:
    """The command line (see the module's docstring)."""
    parser = CliParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_dir", default="out/trackio_view", help="the short run's folder (a new one)")
    parser.add_argument("--project", default="gpt2-accelerate-view", help="trackio project (train.py's "
                                                                          "--wandb_project)")
    parser.add_argument("--screenshot", default="trackio_dashboard.png", help="where the PNG goes")
    parser.add_argument("--no_train", action="store_true", help="show the project's runs as they are")
    parser.add_argument("--chromium", default=None, help=f"the browser; default: the first of "
                                                         f"{', '.join(CHROMIUM_NAMES)} on PATH")
    args = parser.parse_args(argv)
    chromium = find_chromium(args.chromium)
    if chromium is None:
        raise UserError(f"no {args.chromium or 'chromium'} on PATH; apt-get install chromium (or pass --chromium "
                        "PATH)")
    try:
        import trackio  # noqa: F401
    except ImportError:
        raise UserError("trackio is not installed; pip install -e \".[trackio]\"") from None
    if not args.no_train:
        train(Path(args.out_dir), args.project)
    page, dom = look(args.project, Path(args.screenshot), chromium)
    print(f"{page} -> {args.screenshot} ({dom.count('<canvas')} plots)")


if __name__ == "__main__":
    run_cli(main)
