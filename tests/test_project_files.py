"""conftest.project_files, what the tests that read the code read: the project's own files, never a virtual
environment, a run's output or anything .gitignore names, in a git clone and in a tarball alike.

`test_architecture.py`, `test_dependencies.py` and `test_config.py::test_every_preset_parses` read files through it, so
a `.venv/` inside the clone changes nothing for them.

Seen to catch: a `.venv/` holding a non-UTF-8 `.py` and a copy of peft: the older versions of test_architecture and
test_dependencies fail (`UnicodeDecodeError`, issue 36), the current ones pass, and still fail when their claims are
broken (`import eval.common` in train.py or in an untracked `scratch_break.py`; `peft` undeclared). In the helper: the
NOT_THE_PROJECTS filter removed, `--exclude-standard` dropped, or the walk's .gitignore check dropped: each fails a test
here."""
from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import project_files

OURS = [".gitignore", "new.py", "pkg/__init__.py", "pkg/mod.py", "train.py"]


def clone_like(root: Path) -> None:
    """A project as a user has it after the README's Quick start: its files, a .venv/ (that this .gitignore does
    not name, as a user's own .gitignore might not), a venv/, a run's output, caches."""
    files = {".gitignore": "/out/\n__pycache__/\n*.log\n", "train.py": "", "pkg/__init__.py": "", "pkg/mod.py": "",
             "new.py": "",  # not yet committed: still the project's
             "out/run/sample.py": "", "pkg/__pycache__/mod.cpython-311.pyc": "", "pkg/debug.log": "",
             ".venv/lib/python3.11/site-packages/peft/__init__.py": "", "venv/lib/x.py": "", "secret.txt": ""}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / ".venv" / "lib" / "latin1.py").write_bytes(b"# \xa4\n")


def listed(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in project_files(root)]


def test_a_tarball_lists_its_files_less_environments_outputs_and_what_gitignore_names(tmp_path):
    clone_like(tmp_path)
    assert listed(tmp_path) == sorted([*OURS, "secret.txt"])


def test_a_git_clone_lists_what_git_tracks_and_the_untracked_files_it_does_not_ignore(tmp_path):
    clone_like(tmp_path)
    (tmp_path / "gone.py").write_text("")

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    git("add", ".gitignore", "train.py", "pkg/__init__.py", "pkg/mod.py", "gone.py")
    (tmp_path / "gone.py").unlink()  # deleted, not yet committed: no longer the project's
    # Ignored by git's other rules only (not .gitignore): proof that git's list, not the walk, is read.
    (tmp_path / ".git" / "info" / "exclude").write_text("secret.txt\n")
    assert listed(tmp_path) == OURS
    assert [p.name for p in project_files(tmp_path, suffix=".py")] == ["new.py", "__init__.py", "mod.py", "train.py"]
