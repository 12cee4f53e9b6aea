"""Every third-party package the code imports is declared in pyproject.toml, where a fresh install gets it.

A package that is only on a machine because someone installed it by hand (or because another dependency
happens to pull it in today) is missing on a user's fresh install: CI would be green there and red
everywhere else. So every import of every Python file is read with `ast` (module level and inside
functions), mapped to the distribution that provides it (`importlib.metadata.packages_distributions`), and
checked against the declared requirements. The files are the project's own (`conftest.project_files`): a
virtual environment inside the clone (the README's `.venv/`) holds other packages' sources, whose names would pass
for the project's modules and whose imports are not the project's:

- product code (everything outside tests/ and benchmarks/): the core `dependencies`, so that
  `pip install -e .` runs every feature; the exceptions are optional bridges whose packages stay in an
  extra (`OPTIONAL`: lm-eval, DeepSpeed), and which say in one line what to install when it is missing; and
  Triton, which torch's CUDA wheels bring, and without which a CUDA run takes the full logits;
- tests/ and benchmarks/: the core dependencies or the `dev` extra (what `.ci/run` installs).
"""
from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

from conftest import REPO_ROOT, project_files

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (the dev extra)
    import tomli as tomllib

# Imported by product code but installed only with an extra: {top-level module: extra}.
OPTIONAL = {"lm_eval": "harness", "deepspeed": "deepspeed", "triton": "cuda"}
DEV_ONLY_FOLDERS = ("tests", "benchmarks")


def normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): lower case, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalized(re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0])


def declared(pyproject: dict) -> tuple[set[str], dict[str, set[str]]]:
    project = pyproject["project"]
    core = {requirement_name(r) for r in project.get("dependencies", [])}
    extras = {extra: {requirement_name(r) for r in reqs}
              for extra, reqs in project.get("optional-dependencies", {}).items()}
    return core, extras


def local_modules(root: Path) -> set[str]:
    """Names that resolve to this repository's own code (packages, scripts, test helpers)."""
    files = project_files(root, suffix=".py")
    return {p.stem for p in files} | {p.parent.name for p in files if p.name == "__init__.py"}


def imports(file: Path) -> list[tuple[str, int]]:
    """(top-level module, line) of every absolute import in the file, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name.split(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], node.lineno))
    return found


def undeclared_imports(root: Path, pyproject: dict) -> list[str]:
    """One line per import whose distribution a fresh install of the right kind would lack."""
    core, extras = declared(pyproject)
    dev = core | extras.get("dev", set())
    local, providers = local_modules(root), metadata.packages_distributions()
    problems = []
    for file in project_files(root, suffix=".py"):
        rel = file.relative_to(root)
        dev_only = rel.parts[0] in DEV_ONLY_FOLDERS
        for module, line in imports(file):
            if module in sys.stdlib_module_names or module in local or module == "__future__":
                continue
            dists = {normalized(d) for d in providers.get(module, [])} or {normalized(module)}
            if dev_only:
                allowed, where = dev, "[project].dependencies or the dev extra"
            elif module in OPTIONAL:
                allowed = core | extras.get(OPTIONAL[module], set())
                where = f"[project].dependencies or the {OPTIONAL[module]} extra"
            else:
                allowed, where = core, "[project].dependencies"
            if not dists & allowed:
                problems.append(f"{rel}:{line} imports {module} (distribution {'/'.join(sorted(dists))}), "
                                f"which is not in {where}")
    return problems


def test_every_imported_package_is_declared_where_a_fresh_install_gets_it():
    """Every package the code imports is declared where a fresh install gets it: product code in the core dependencies
    (lm-eval, the one optional bridge, in the `harness` extra), tests and benchmarks in core or `dev`.

    Seen to catch: `peft` deleted from `[project].dependencies`: fails naming `model/lora.py` (and the 3 test imports).
    `pyarrow` deleted: fails naming `data/local.py` and the benchmarks."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert undeclared_imports(REPO_ROOT, pyproject) == []


def test_a_package_removed_from_pyproject_is_reported(tmp_path):
    """The check itself: drop peft (imported by model/lora.py) from the core list and it must be named."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    core = pyproject["project"]["dependencies"]
    assert any(requirement_name(r) == "peft" for r in core)
    pyproject["project"]["dependencies"] = [r for r in core if requirement_name(r) != "peft"]
    problems = undeclared_imports(REPO_ROOT, pyproject)
    assert problems and all("imports peft" in p for p in problems), problems
    assert any(p.startswith("model/lora.py:") for p in problems)


def test_a_product_import_that_only_the_dev_extra_declares_is_reported(tmp_path):
    """A package the tests get through `.[dev]` is still missing after a user's `pip install -e .`.

    Seen to catch: not broken on purpose: this is the check's own test."""
    (tmp_path / "tool.py").write_text("def f():\n    import pytest\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("import pytest\n")
    pyproject = {"project": {"dependencies": [], "optional-dependencies": {"dev": ["pytest>=8"]}}}
    assert undeclared_imports(tmp_path, pyproject) == [
        "tool.py:2 imports pytest (distribution pytest), which is not in [project].dependencies"]


def test_the_optional_bridge_says_which_install_brings_it(monkeypatch):
    """lm-eval stays in an extra: without it, the bridge is one line naming the pip install."""
    import pytest

    from common.errors import UserError
    from eval.harness import require_lm_eval

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now raises ImportError
    with pytest.raises(UserError, match=r"pip install lm-eval \(or pip install -e \"\.\[harness\]\"\)"):
        require_lm_eval()
