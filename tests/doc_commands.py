"""What the README and the docs tell a newcomer to run, in reading order, and where each of it runs (issue 60).

A page's commands are the lines of its ```bash blocks (a trailing `\\` and an open quote join the next line; `&&` and
`;` part two commands; comments dropped) and its ```python blocks, one snippet each; the README's also include the
inline commands of its prose (`python ...`, `accelerate launch ...`, `sbatch ...`, `trackio ...`), its table of what
to do next. The docs' prose names commands in passing (a flag, a tool, a case of faults.md's table); their blocks and
the README's table show them whole. The pages are read in the README's order: the README, then the docs as its
Documentation list links them.

`ELSEWHERE` says, for each command a test here cannot run as written, what it needs instead (the first rule that
matches). Every other command runs, as written, in a copy of a clone after the Quick start
(`conftest.quick_start`), in this process: train.py's entry point, a `python -m` module as `__main__`, a snippet in a
namespace of its own.
"""
from __future__ import annotations

import io
import re
import runpy
import shlex
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO_ROOT, fresh_accelerate_state

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
INLINE_COMMAND = re.compile(r"(python |accelerate launch |sbatch |trackio )")

# (pattern, what the command needs that a test here has not), the first that matches says why it is not run.
ELSEWHERE: tuple[tuple[str, str], ...] = (
    (r"^(python -m venv|source \.venv|pip install|python -m pytest)", "the install and the tests: CI's own "
                                                                      "commands, which tests/test_readme.py holds to "
                                                                      ".ci/run"),
    (r"^python train\.py$", "the Quick start itself: conftest.quick_start runs it, as written"),
    (r"<[^>]+>|\.\.\.|\$[A-Za-z{]|^[A-Z_]+=|^cmp |\[--|^#!", "a recipe to fill in: placeholders, shell variables, a "
                                                              "job script"),
    (r"my_corpus\.txt|pairs\.jsonl|qa\.jsonl|corpus/|hellaswag_val\.jsonl|prompt\.txt|my\.yaml|out/my_run|"
     r"runs/my_run|out/checkpoints/|/shared/|/tmp/|\bsaved_folder\b", "the reader's own files"),
    (r"accelerate_configs/(8gpu|single_gpu|multinode)|--num_processes 8|^sbatch ", "GPUs, or a cluster"),
    (r"--init_from gpt2\b|--model gpt2( |$)|\"gpt2\"|user/name|HuggingFaceFW/|Skylion007/|publish\.hub|"
     r"push_to_hub|eval\.harness|eval\.hellaswag(?!.*--data )|model=\"|--model out/qa\b",
     "the Hugging Face Hub: GPT-2's weights (and what is fine-tuned from them), a Hub dataset or HellaSwag's items, a "
     "push"),
    (r"--max_steps 1000|--out_dir out/tracked", "a new training run of a minute or more: the Quick start's is the one "
                                                "run of the default recipe here (tests/test_trackio.py trains with "
                                                "--report_to trackio)"),
    (r"^trackio show|--interactive|^echo .*\|", "a dashboard server, or a terminal session"),
)


@dataclass(frozen=True)
class Shown:
    """One command or snippet of a page: `kind` "command" or "python", `line` where it starts."""

    page: str
    line: int
    kind: str
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text.strip().splitlines()[0]}"

    @property
    def elsewhere(self) -> str | None:
        """Why it does not run here (`ELSEWHERE`), None when it does."""
        return next((why for pattern, why in ELSEWHERE if re.search(pattern, self.text, re.M)), None)


def pages() -> list[Path]:
    """The README, then the docs pages in the order its Documentation list links them, then any it does not link."""
    listed = README.read_text(encoding="utf-8").split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    linked = [REPO_ROOT / target for target in LINK.findall(listed)]
    ordered = list(dict.fromkeys(page for page in linked if page.parent == DOCS and page.suffix == ".md"))
    return [README, *ordered, *sorted(set(DOCS.glob("*.md")) - set(ordered))]


def commands_of(block: str) -> list[tuple[int, str]]:
    """(line offset, command) of a bash block, as a shell reads it."""
    found, pending, start = [], "", 0
    for offset, line in enumerate(block.splitlines()):
        if not pending:
            start = offset
        pending += (" " if pending else "") + line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        if pending.count('"') % 2:  # a quoted value that goes on over the next line
            continue
        text = re.sub(r"(^|\s+)#(?![!]).*$", "", pending) if not pending.startswith("#!") else pending
        for command in re.split(r"\s+&&\s+|;\s+", text):
            if command.strip():
                found.append((start, command.strip()))
        pending = ""
    return found


def shown_on(page: Path) -> list[Shown]:
    """Everything `page` shows to run, in reading order."""
    text = page.read_text(encoding="utf-8")
    name = str(page.relative_to(REPO_ROOT))
    found = []
    for block in re.finditer(r"```(\w*)\n(.*?)```", text, re.S):
        first = text.count("\n", 0, block.start()) + 2
        language, body = block.group(1), block.group(2)
        if language == "python":
            found.append(Shown(name, first, "python", body))
        elif language == "bash" and body.startswith("#!"):
            found.append(Shown(name, first, "command", body))  # a job script, whole
        elif language == "bash":
            found += [Shown(name, first + offset, "command", command) for offset, command in commands_of(body)]
    if page == README:
        prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
        for span in re.finditer(r"`([^`\n]+)`", prose):
            if INLINE_COMMAND.match(span.group(1)):
                found.append(Shown(name, prose.count("\n", 0, span.start()) + 1, "command", span.group(1)))
    return sorted(found, key=lambda shown: shown.line)


def run_here(shown: Shown, clone: Path) -> tuple[int, str]:
    """Run `shown` as written in `clone`, in this process: its exit status (0 for a snippet that raised nothing) and
    what it printed. train.py through its entry point, `python -m X` as `__main__` (runpy), a snippet in a namespace
    of its own; on one thread, as the suite's launched processes, with accelerate's state as a new interpreter's."""
    import torch

    out, threads, status = io.StringIO(), torch.get_num_threads(), 0
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(out), redirect_stderr(out), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules after import of package"
        mp.chdir(clone)
        torch.set_num_threads(1)
        fresh_accelerate_state()
        try:
            if shown.kind == "python":
                exec(compile(shown.text, str(shown), "exec"), {"__name__": "__main__"})
            else:
                words = shlex.split(shown.text)
                assert words[0] == "python" and (words[1] == "train.py" or words[1] == "-m"), shown
                if words[1] == "train.py":
                    import train

                    mp.setattr(sys, "argv", words[1:])
                    train.run_cli(train.main)
                else:
                    mp.setattr(sys, "argv", words[2:])
                    runpy.run_module(words[2], run_name="__main__")
        except SystemExit as exit_info:
            status = exit_info.code if isinstance(exit_info.code, int) else int(exit_info.code is not None)
        finally:
            torch.set_num_threads(threads)
            fresh_accelerate_state()
    return status, out.getvalue()
