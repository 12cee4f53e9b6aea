"""Every command and Python snippet that the README and the docs show and that can run offline runs as written, in
the order a newcomer meets them after the Quick start (issue 60: the README's export and resume rows failed right
after it). Each page starts from a copy of a clone after the Quick start's run (`conftest.quick_start`, run once),
and runs its commands in reading order: what the page shows before a command is what a reader has done before it.
What a command needs that a test has not (the Hub, a GPU, the reader's own files) is said by `doc_commands.ELSEWHERE`;
every other command runs (tests/doc_commands.py says how)."""
from __future__ import annotations

import shlex

import pytest
from conftest import QUICK_START_GROUP, REPO_ROOT, after_quick_start
from doc_commands import ELSEWHERE, pages, run_here, shown_on

# What a command's output says when it did what the page says it does (beside exit 0), by command.
SAYS = {
    "python train.py --resume latest --max_steps 500": "step 500: val_loss",
    "python -m model.export --checkpoint out/shakespeare/checkpoints/step_000480 --out_dir export/":
        "read out/shakespeare/checkpoints/step_000480 (step 480",
    "python train.py --resume latest": "the run had already finished: step 480 is its --max_steps",
    "python train.py --resume out/shakespeare/checkpoints/step_000400": "resuming from step_000400: the newer "
                                                                        "checkpoints (step_000480) and final/",
    "python train.py --config configs/gpt2_350m_fineweb_edu.yaml --plan": "Memory plan",
    "python -m eval.val_loss --model out/shakespeare": "val_loss",
    "python -m publish.card --run_dir out/shakespeare": "model card and curves written to out/shakespeare/final",
}
RUN_HERE = [str(page.relative_to(REPO_ROOT)) for page in pages()
            if any(shown.elsewhere is None for shown in shown_on(page))]


def test_each_command_shown_runs_here_or_says_what_it_needs():
    """The pages show commands that run here, each as train.py or a `python -m` module (what `run_here` runs), and
    every rule of `ELSEWHERE` still names some command (a rule that names none is left over: remove it)."""
    shown = [s for page in pages() for s in shown_on(page)]
    runs = [s for s in shown if s.elsewhere is None]
    assert len(runs) >= 15, [str(s) for s in runs]
    for s in runs:
        assert s.kind == "python" or shlex.split(s.text)[:2] in (["python", "train.py"], ["python", "-m"]), str(s)
    unused = [pattern for pattern, why in ELSEWHERE if not any(s.elsewhere == why for s in shown)]
    assert not unused, unused
    assert set(SAYS) <= {s.text for s in runs}, set(SAYS) - {s.text for s in runs}


@pytest.mark.slow
@pytest.mark.xdist_group(QUICK_START_GROUP)
@pytest.mark.parametrize("page", RUN_HERE)
def test_a_pages_commands_run_as_written_after_the_quick_start(page, quick_start, tmp_path):
    """Seen to catch (issue 60): the README's `python -m model.export --checkpoint
    out/shakespeare/checkpoints/step_000100` (the run keeps 300, 400, 480) and `python train.py --resume latest
    --max_steps 200` (the run is at 480); docs/faults.md's `--resume .../step_000100`; docs/generate.md's exports of
    `out/run`."""
    clone = after_quick_start(quick_start, tmp_path / "clone")
    for shown in shown_on(REPO_ROOT / page):
        if shown.elsewhere is not None:
            continue
        status, output = run_here(shown, clone)
        assert status == 0, f"{shown}: exit {status}\n{output[-3000:]}"
        assert SAYS.get(shown.text, "") in output, f"{shown}: no {SAYS[shown.text]!r} in\n{output[-3000:]}"
