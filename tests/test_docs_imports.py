"""The docs' Python snippets and shell lines say what the code does: every name a snippet imports exists, and the
fine-tuning page's prompt reaches model.sample as the data's prompts are written (a real newline at its end)."""
from __future__ import annotations

import argparse
import ast
import re
import subprocess

import pytest
from conftest import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
IMPORT = re.compile(r"^from ([\w.]+) import ([\w, ]+)$", re.M)
PROJECT = {"data", "model", "eval", "common", "configs", "training", "publish", "planner"}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def defined_names(module: str) -> set[str]:
    """The names a project module defines or imports at its top level, read from its source (nothing imported: the
    quick tier does not pay for torch)."""
    path = REPO_ROOT.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_every_name_a_python_snippet_imports_exists():
    """Seen to catch: docs/data.md's Python API importing `DataSettings` from data.settings (the class is
    `DataConfig`)."""
    missing, checked = [], 0
    for page in PAGES:
        for block in python_blocks(page.read_text(encoding="utf-8")):
            for module, names in IMPORT.findall(block):
                if module.split(".")[0] not in PROJECT:
                    continue  # transformers' and torch's names are theirs to keep
                checked += 1
                missing += [f"{page.name}: from {module} import {name.strip()}" for name in names.split(",")
                            if name.strip() not in defined_names(module)]
    assert missing == [] and checked >= 7  # the snippets' imports were found (a changed fence would find none)


@pytest.mark.slow  # starts bash (milliseconds; the quick tier starts no process)
def test_the_fine_tuning_pages_prompt_ends_in_a_newline():
    """bash reads the page's model.sample line; model.sample passes --prompt on as given. Seen to catch: the page's
    `--prompt "Translate to French: cat\\n"`, which passes a backslash and an n (issue 60)."""
    from model.sample import read_prompt

    page = (REPO_ROOT / "docs" / "finetuning.md").read_text(encoding="utf-8")
    (line,) = [line for line in page.splitlines() if line.startswith("python -m model.sample") and "--prompt " in line]
    # A `python` function in place of the interpreter prints the arguments bash gives it, one per NUL.
    argv = subprocess.run(["bash", "-c", 'python() { printf "%s\\0" "$@"; }; ' + line], capture_output=True,
                          text=True, check=True).stdout.split("\0")
    prompt = argv[argv.index("--prompt") + 1]
    assert prompt == "Translate to French: cat\n"
    args = argparse.Namespace(prompt=prompt, prompt_file=None)
    assert read_prompt(args, stdin=None) == prompt  # kept as given, its newline included
