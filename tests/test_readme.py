"""The README as a newcomer meets it: its Quick start is the commands CI runs (install and tests; the first training
beside them), each with its time stated, and its Layout names only files that are there."""
from __future__ import annotations

import re

from conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
CI = REPO_ROOT / ".ci" / "run"


def code_block_after(heading: str) -> list[str]:
    """The lines of the first fenced block after `heading` in the README."""
    text = README.read_text()
    rest = text[text.index(heading):]
    start = rest.index("```")
    body = rest[rest.index("\n", start) + 1:]
    return body[:body.index("```")].splitlines()


def quick_start() -> list[tuple[str, str]]:
    """(command, comment) of each line of the Quick start."""
    return [(cmd.strip(), note.strip()) for cmd, _, note in (line.partition("  # ")
                                                              for line in code_block_after("## Quick start"))]


def test_the_quick_start_is_what_ci_runs_with_each_time_stated():
    commands = [cmd for cmd, _ in quick_start()]
    assert commands[2] == "python train.py"  # the first training first, then the tiers
    assert commands[3].endswith('-m "not slow"') and commands[4].endswith("-m slow")
    ci = [line.strip() for line in CI.read_text().splitlines() if line.strip() and not line.startswith("#")]
    for cmd in commands[:2] + commands[3:]:  # CI trains nothing: the install and the two tiers, as written
        assert any(line == cmd or line.startswith(cmd + " --durations") for line in ci), cmd
    for cmd, note in quick_start()[2:]:
        assert re.search(r"\bmin\b", note), (cmd, note)  # how long it takes, on which machine
        assert "2 cores" in note, (cmd, note)


def test_the_layout_names_files_that_are_there():
    named = 0
    folder = None
    for line in code_block_after("## Layout"):
        head = line[:22].strip()
        if head:
            folder = REPO_ROOT / head.split(",")[0] if head.endswith("/") or "/," in head else None
        if folder is None:
            continue
        for name in re.findall(r"\b[\w]+\.(?:py|txt|tiktoken|yaml|json)\b", line[22:]):
            assert (folder / name).is_file() or (REPO_ROOT / name).is_file(), f"{folder.name}/{name}"
            named += 1
    assert named >= 10
