"""The rooms of docs/architecture.md and the arrows between them, read from the code's own imports, and every count
the page gives, computed from the code.

Lower layers never import higher ones, so there is no cycle between packages and `model`/`data`
stay usable as a library without the trainer; inside a package, no module imports another that
imports it back, however indirectly. Imports inside functions count too (a lazy import is still an
arrow).
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, project_files

# What each package may import from the project (besides itself); anything else is a wrong arrow.
ALLOWED = {
    "common": set(),
    "data": {"common"},
    "model": {"common", "data"},
    "eval": {"common", "configs", "data", "model"},
    "configs": {"common", "data"},
    "training": {"common", "configs", "data", "eval", "model"},
    "publish": {"common", "configs", "data", "model", "training"},
    "planner": {"common", "configs", "data", "model", "training"},  # the memory planner, above training/
    "train": {"common", "configs", "data", "eval", "model", "training", "publish", "planner"},  # train.py
    # train: benchmarks.run_phases runs train.py's main with its phases wrapped (nothing imports a benchmark back)
    "benchmarks": {"common", "configs", "data", "eval", "model", "training", "planner", "train"},
}
PACKAGES = set(ALLOWED)

ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
NUMBER_WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
                "eleven": 11, "twelve": 12}


def page_count(pattern: str) -> int:
    """The number docs/architecture.md states where `pattern` (one group: digits or a number word) matches."""
    found = re.search(pattern, ARCHITECTURE.read_text(encoding="utf-8"), re.M)
    assert found, f"docs/architecture.md has no {pattern!r}"
    word = found.group(1).lower()
    return NUMBER_WORDS[word] if word in NUMBER_WORDS else int(word)

# Inside training/: four sub-packages and the root (the loop and the run's record), imports one way down.
# docs/architecture.md draws this table.
TRAINING_ALLOWED = {
    "root": {"checkpoints", "distributed", "optimizers", "evaluations"},  # step, metrics, run_folder, recipe, ...
    "checkpoints": {"distributed", "optimizers"},  # each engine's checkpoint format
    "distributed": {"optimizers"},  # the support table reads the optimizers' cells; prepare builds them
    "optimizers": set(),
    "evaluations": set(),
}


def package_files(package: str) -> list[Path]:
    """The project's own .py files of one package (conftest.project_files: never a venv or an output inside it)."""
    return [path for path in project_files(suffix=".py") if path.relative_to(REPO_ROOT).parts[0] == package]


def project_imports(path: Path) -> set[str]:
    """Top-level project packages that a file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & (PACKAGES | {"train"})


def test_packages_import_only_lower_layers():
    """The package layering: no module imports a higher layer (docs/architecture.md).

    Seen to catch: `model/hf_io.py` (now `model/pretrained.py`) importing `training.mfu`."""
    wrong = []
    for package, allowed in ALLOWED.items():
        for path in package_files(package):
            for target in project_imports(path) - allowed - {package}:
                wrong.append(f"{path.relative_to(REPO_ROOT)} imports {target}")
    assert wrong == []


def module_graph() -> dict[str, set[str]]:
    """Every project module (`model.gpt`, `model` for model/__init__.py, `train`) and the project modules it
    imports anywhere in it: `from model import GPT` is an arrow to `model`, `from model import lora` one
    to `model.lora`. (Importing `model.gpt` also runs model/__init__.py; that arrow is Python's, not the code's.)"""
    files = {path: ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
             for package in PACKAGES for path in package_files(package)}
    files[REPO_ROOT / "train.py"] = "train"
    modules = set(files.values())
    graph = {}
    for path, name in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                targets |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                            for alias in node.names}
        graph[name] = targets - {name}
    return graph


def test_no_module_imports_itself_back():
    """No circle of imports between modules, lazy ones included (e.g. model.gpt -> model.pretrained -> model.gpt).

    Seen to catch: a lazy `from model.gpt import GPT` inside a function of `model/pretrained.py`; `from model import
    gpt` in `model/lora.py`. Each fails naming the circle through `model.gpt`."""
    graph, state, circles = module_graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]))
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert circles == []


def training_part(module: str) -> str | None:
    """Which part of training/ a module is in ("distributed", ..., "root" for training/*.py), None outside it."""
    parts = module.split(".")
    if parts[0] != "training":
        return None
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in TRAINING_ALLOWED) else "root"


def back_arrows(graph: dict[str, set[str]]) -> list[str]:
    """The imports between parts of training/ that TRAINING_ALLOWED does not allow."""
    wrong = []
    for source, targets in graph.items():
        for target in targets:
            a, b = training_part(source), training_part(target)
            if a and b and a != b and b not in TRAINING_ALLOWED[a]:
                wrong.append(f"{source} ({a}) imports {target} ({b})")
    return sorted(wrong)


def test_training_sub_packages_import_one_way():
    """training/ has four sub-packages and a root of at most 12 modules, imported one way: root -> checkpoints ->
    distributed -> optimizers, evaluations alone (the table in docs/architecture.md). The page's heading counts the
    sub-packages.

    Seen to catch: `from training.checkpoints.resume import Progress` in `training/distributed/layout.py`: fails naming
    that import. The page's heading made "five sub-packages": fails."""
    graph = module_graph()
    assert back_arrows(graph) == []
    assert {training_part(m) for m in graph} - {None} == set(TRAINING_ALLOWED)  # no part without a row
    sub_packages = {path.parent.name for path in (REPO_ROOT / "training").glob("*/__init__.py")}
    assert len(sub_packages) == page_count(r"^## training/: (\w+) sub-packages") == len(TRAINING_ALLOWED) - 1
    root = sorted(m for m in graph if training_part(m) == "root" and m != "training")
    assert len(root) <= 12, root  # the loop and the run's record; the rest lives in a sub-package
    # The check can fail: a distributed module reaching back into the checkpoints is one wrong arrow.
    assert back_arrows({"training.distributed.layout": {"training.checkpoints.resume"}}) == \
        ["training.distributed.layout (distributed) imports training.checkpoints.resume (checkpoints)"]


def test_allowed_arrows_have_no_cycle():
    # Depth-first search over ALLOWED: the layering itself must be a DAG for the test above to mean it.
    state: dict[str, str] = {}

    def visit(node: str) -> None:
        state[node] = "open"
        for nxt in ALLOWED[node]:
            assert state.get(nxt) != "open", f"cycle through {node} -> {nxt}"
            if nxt not in state:
                visit(nxt)
        state[node] = "done"

    for package in ALLOWED:
        if package not in state:
            visit(package)
    # training/'s own table is a ladder: each part may import only parts below it.
    order = ["optimizers", "evaluations", "distributed", "checkpoints", "root"]
    assert all(TRAINING_ALLOWED[p] <= set(order[:i]) for i, p in enumerate(order))


def test_nothing_binds_the_name_eval():
    """`import eval.x` would shadow the builtin `eval` in that module; `from eval.x import y` does not. Every .py file
    of the project's, tests and scripts included (not a virtual environment's inside the clone)."""
    offenders = []
    for path in project_files(suffix=".py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "eval" and a.asname is None
                                                    for a in node.names):
                offenders.append(str(path.relative_to(REPO_ROOT)))
    assert offenders == []


@pytest.mark.slow
def test_importing_a_package_installs_no_handlers_or_filters():
    """Importing the training machinery must not change the process: signal handlers and logging
    filters are installed by the objects that need them, when they are created.

    Seen to catch: the tied-weight log filter installed when `training/checkpoints/checkpoint.py` is imported (as it
    once was)."""
    script = (
        "import signal, logging\n"
        "before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1))\n"
        "import train, training.checkpoints.checkpoint, training.preemption, training.run_folder, publish.uploads\n"
        "after = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1))\n"
        "assert before == after, (before, after)\n"
        "assert not logging.getLogger('accelerate.utils.other').filters\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_planner_is_one_way_inside():
    """planner/: launch -> memory -> advice -> render -> cli, each module importing only those before it (the
    package's docstring); `planner/__init__.py` gathers them and none imports it back.

    Seen to catch: `planner/memory.py` importing `planner.render`: this test and the import-circle test fail."""
    order = ["planner.launch", "planner.memory", "planner.advice", "planner.render", "planner.cli"]
    graph = module_graph()
    assert sorted(name for name in graph if name.startswith("planner")) == sorted(order + ["planner"])
    for i, name in enumerate(order):
        inside = {target for target in graph[name] if target.startswith("planner")}
        assert inside <= set(order[:i]), f"{name} imports {sorted(inside - set(order[:i]))}"


# What the rest of the code asks of an engine it asks the layout (`Layout`) or the engine's own objects: a branch
# on the engine's identity belongs in training/distributed/ or the checkpoint code (each engine's format).
ENGINE_BRANCH = re.compile(r"\.kind\s*[!=]=|distributed_type\s*[!=]=|isinstance\([^)]*PipelinedGPT|"
                           r"tensor_parallel\s*>\s*1|pipeline_parallel\s*>\s*1|zero_stage\s*(?:[!=<>]=?|in\b)")
ENGINE_HOMES = ("training/distributed/", "training/checkpoints/", "common/engine_names.py", "common/parallelism.py",
                "tests/", "benchmarks/")
ENGINE_BRANCHES_ALLOWED = 2  # issue 54 asked for at most 8; two remain: the advice's spelling, the pipeline step


def engine_branches() -> list[str]:
    found = []
    for path in project_files(suffix=".py"):
        rel = path.relative_to(REPO_ROOT).as_posix()
        if rel.startswith(ENGINE_HOMES):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#")[0]
            if ENGINE_BRANCH.search(code):
                found.append(f"{rel}:{number}: {line.strip()}")
    return found


def test_the_engine_is_asked_through_the_layout():
    """What the rest of the code asks of an engine it asks the layout: outside `training/distributed/`, the checkpoint
    code and the engines' names, at most 2 lines branch on the engine (`.kind ==`, `distributed_type ==`,
    `isinstance(.., PipelinedGPT)`, `tensor_parallel > 1`, `pipeline_parallel > 1`, `zero_stage` comparisons; issue 54
    asked for 8, from 57). docs/architecture.md states how many.

    Seen to catch: it failed on the planner's and the header's 20 branches before `Launch` held a `Layout`; a merge's
    `zero=engine.kind == DEEPSPEED` in train.py failed it at 3. The page's "two" made "three": fails."""
    found = engine_branches()
    assert len(found) <= ENGINE_BRANCHES_ALLOWED, "\n".join(found)
    assert len(found) == page_count(r"(\w+) lines still branch on the engine"), "\n".join(found)


# ---- what a new degree touches ---------------------------------------------------------------------------------
# A degree is declared once, as a `common.parallelism.Degree`; tests/test_degrees.py proves that a registered toy
# reaches the flags, the header, the support table, the layout's refusals, the planner and the resume rules with no
# other file. What a real degree touches besides is its own modules (named after it) and each file that asks a
# launch for it by name. docs/architecture.md states the larger count of the built-in degrees.
PRODUCT = ("common", "data", "model", "configs", "eval", "training", "planner", "publish", "train.py")
DEGREE_FILES_AT_MOST = 8  # issue 61: a next degree touched about 13 files


def names_of(degree) -> tuple[set[str], set[str]]:
    """How the code asks a launch for `degree` by name: as an attribute or keyword (its flag's name, and each
    property of `Parallelism` whose code reads it, e.g. `pipelined`), or by its constant in common/parallelism.py."""
    import inspect

    from common import parallelism

    constants = {key for key, value in vars(parallelism).items() if value is degree}
    attributes = {degree.name}
    for key, value in vars(parallelism.Parallelism).items():
        if isinstance(value, property) and re.search(rf"\b({'|'.join(attributes | constants)})\b",
                                                     inspect.getsource(value.fget)):
            attributes.add(key)
    return attributes, constants


def degree_files(degree) -> list[str]:
    """The product files `degree` touches: its own modules (`pipeline.py` for `pipeline_parallel`), and each file
    that asks a launch for it by name (`names_of`), its declaration included. A file that only calls into its
    modules (train.py's `split(...)`) is not counted."""
    attributes, constants = names_of(degree)
    found = set()
    for path in project_files(suffix=".py"):
        rel = path.relative_to(REPO_ROOT).as_posix()
        if not rel.startswith(PRODUCT):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
            if (isinstance(node, ast.Attribute) and node.attr in attributes) or \
                    (isinstance(node, (ast.keyword, ast.arg)) and node.arg in attributes) or \
                    (isinstance(node, ast.Name) and node.id in constants) or \
                    (isinstance(node, ast.alias) and node.name in constants):
                found.add(rel)
                break
        if path.stem in (degree.name, degree.name.split("_")[0]):
            found.add(rel)
    return sorted(found)


def test_a_new_degree_touches_the_files_the_architecture_page_says():
    """Seen to catch: `def degrees(tensor_parallel: int = 1)` put back into common/engine_names.py (a ninth file for
    tensor parallelism), and the page's row left at its former "about 7"."""
    from common.parallelism import DEGREES, PIPELINE, TENSOR

    counts = {degree.name: degree_files(degree) for degree in DEGREES.values() if degree in (TENSOR, PIPELINE)}
    assert set(counts) == {"tensor_parallel", "pipeline_parallel"}
    most = max(len(files) for files in counts.values())
    assert most <= DEGREE_FILES_AT_MOST, counts
    assert page_count(r"^\| degree, e\.g\. context parallelism \| (\d+) \|") == most, counts
    # The count can fail: a file that asks for the pipeline by name is one more.
    assert "training/distributed/layout.py" in counts["pipeline_parallel"]


# ---- what a new data source and a new refused feature touch -----------------------------------------------------

def names_in(path: Path) -> set[str]:
    """The identifiers a file's code uses: names, attributes, imported names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name.split(".")[-1])
    return found


def product_files() -> list[Path]:
    return [path for path in project_files(suffix=".py") if path.relative_to(REPO_ROOT).as_posix().startswith(PRODUCT)]


def test_a_new_data_source_touches_the_files_the_architecture_page_says():
    """A data source is one `DataSource` class (data/source.py) with its reader, a module of its own in data/. It
    also touches each product file that names a source's class: `open_source`'s dispatch, and `data.prepare`'s
    choice of what it tokenizes. Counted for every source that ships; docs/architecture.md states the larger.

    Seen to catch: the row's former 2 (data/prepare.py's `isinstance` checks were not counted): fails. An
    `isinstance(source, TokenShards)` added to training/recipe.py: fails at 4."""
    import data.source

    sources = [cls for cls in vars(data.source).values() if isinstance(cls, type)
               and issubclass(cls, data.source.DataSource) and cls is not data.source.DataSource]
    names = {path.relative_to(REPO_ROOT).as_posix(): names_in(path) for path in product_files()}
    files = {cls.__name__: sorted(rel for rel, used in names.items() if cls.__name__ in used) for cls in sources}
    assert len(files) >= 5 and all("data/source.py" in named for named in files.values()), files
    most = 1 + max(len(named) for named in files.values())  # its reader, and the files that name it
    assert page_count(r"^\| data source \| (\d+) \|") == most, files


def test_a_refused_feature_touches_the_files_the_architecture_page_says():
    """A feature refused under an engine is one row of `SUPPORT` (training/distributed/support.py). It also touches
    each product file that names the feature as the table spells it, a degree that refuses it included
    (common/parallelism.py), and each caller of `refuse_unsupported`, which passes the flag's value. Counted for every
    such feature; docs/architecture.md states the larger. An optimizer's or a degree's own row is counted with it.

    Seen to catch: the row's former 1 (the check and train.py's call were not counted): fails. A second caller of
    `refuse_unsupported` (planner/launch.py): fails at 5."""
    from training.distributed.support import SUPPORT

    def strings_in(path: Path) -> set[str]:
        return {node.value for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path)))
                if isinstance(node, ast.Constant) and isinstance(node.value, str)}

    strings = {path.relative_to(REPO_ROOT).as_posix(): strings_in(path) for path in product_files()}
    callers = {path.relative_to(REPO_ROOT).as_posix() for path in product_files()
               if "refuse_unsupported" in names_in(path)}
    files = {feature: sorted(rel for rel, used in strings.items() if feature in used or rel in callers)
             for feature in SUPPORT}
    assert set(files) == {"--lora_rank", "--on_nan skip"} and callers, files
    most = max(len(named) for named in files.values())
    assert page_count(r"^\| feature refused under an engine \| (\d+) \|") == most, files


# ---- every count the page gives is computed ---------------------------------------------------------------------
# Each phrase of docs/architecture.md that states a count (a regex, the number its group) and the test that computes
# it from the code and compares the page. A count added to the page gets a row here and a test that computes it.
PAGE_COUNTS = {
    r"^## training/: (\w+) sub-packages": "test_architecture.py::test_training_sub_packages_import_one_way",
    r"(\w+) lines still branch on the engine": "test_architecture.py::test_the_engine_is_asked_through_the_layout",
    r"^\| optimizer \| (\d+) \|":
        "test_registries.py::test_a_new_optimizer_costs_the_product_files_docs_architecture_states",
    r"^\| evaluation \| (\d+) \|":
        "test_registries.py::test_a_new_evaluation_costs_the_product_files_docs_architecture_states",
    r"^\| degree, e\.g\. context parallelism \| (\d+) \|":
        "test_architecture.py::test_a_new_degree_touches_the_files_the_architecture_page_says",
    r"^\| data source \| (\d+) \|":
        "test_architecture.py::test_a_new_data_source_touches_the_files_the_architecture_page_says",
    r"^\| feature refused under an engine \| (\d+) \|":
        "test_architecture.py::test_a_refused_feature_touches_the_files_the_architecture_page_says",
}
NOT_COUNTS = (r"exit 2",)  # an exit status
NUMBER = re.compile(rf"\b(\d[\d,.]*|{'|'.join(NUMBER_WORDS)})\b", re.I)


def test_every_count_on_the_architecture_page_is_computed():
    """Every number docs/architecture.md states, as digits or a word from two to twelve, is a count one of
    PAGE_COUNTS' tests computes from the code and compares to the page (issue 61: three of its counts had gone
    stale). Code spans and code blocks are not read; "one" is not read as a count. Each named test exists.

    Seen to catch: "about 7 files" written into a row's prose: fails naming line and number. A PAGE_COUNTS test
    renamed: fails naming it."""
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group().count("\n"), ARCHITECTURE.read_text(encoding="utf-8"),
                  flags=re.S)
    text = re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group()), text)
    covered = [m.span(1) for pattern in PAGE_COUNTS for m in re.finditer(pattern, text, re.M)]
    covered += [m.span() for pattern in NOT_COUNTS for m in re.finditer(pattern, text)]
    stray = [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group()!r}" for m in NUMBER.finditer(text)
             if not any(a <= m.start() and m.end() <= b for a, b in covered)]
    assert stray == [], f"counts on docs/architecture.md that no test computes: {stray}"
    assert all(re.search(pattern, text, re.M) for pattern in PAGE_COUNTS), "a PAGE_COUNTS phrase left the page"
    for name in PAGE_COUNTS.values():
        file, _, test = name.partition("::")
        tree = ast.parse((REPO_ROOT / "tests" / file).read_text(encoding="utf-8"))
        assert any(isinstance(node, ast.FunctionDef) and node.name == test for node in tree.body), name
