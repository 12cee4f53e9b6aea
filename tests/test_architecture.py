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
    "checkpoint_io": {"common"},  # a checkpoint's files under every engine: below model/ and training/ alike
    "model": {"common", "data", "checkpoint_io"},
    "eval": {"common", "checkpoint_io", "configs", "data", "model"},
    "configs": {"common", "data"},
    "training": {"common", "checkpoint_io", "configs", "data", "eval", "model"},
    "publish": {"common", "checkpoint_io", "configs", "data", "model", "training"},
    "planner": {"common", "checkpoint_io", "configs", "data", "model", "training"},  # the memory planner
    "train": {"common", "checkpoint_io", "configs", "data", "eval", "model", "training", "publish", "planner"},
    # train: benchmarks.run_phases runs train.py's main with its phases wrapped (nothing imports a benchmark back)
    "benchmarks": {"common", "checkpoint_io", "configs", "data", "eval", "model", "training", "planner", "train"},
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
PRODUCT = ("common", "checkpoint_io", "data", "model", "configs", "eval", "training", "planner", "publish",
           "train.py")
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


# One road for a checkpoint (issue 61): checkpoint_io/ reads every engine's files, for a resume, a move, export,
# sample and eval alike. docs/architecture.md states both bounds.
RESTORE_RETURNS_ALLOWED = 5  # issue 61 asked for at most 5; 10 before checkpoint_io/
ENGINE_LIBRARIES = ("deepspeed", "torch.distributed.checkpoint", "accelerate.utils.constants")  # engines' formats


class Route:
    """Follows one value through the project's functions, call by call, in the order the code is written (a call's
    arguments before the call). A function is entered where a call hands it the value, or a name assigned from an
    expression that holds it; each function once. A call resolves through its file's definitions and imports, a
    method through `self` or the annotation of the name it is called on (`move: Move | None`). Building an object
    is no stop. A stop is a run of functions entered one after another in one file."""

    def __init__(self) -> None:
        graph_files = {path: ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
                       for package in PACKAGES for path in package_files(package)}
        graph_files[REPO_ROOT / "train.py"] = "train"
        self.trees = {name: ast.parse(path.read_text(encoding="utf-8")) for path, name in graph_files.items()}
        self.paths = {name: path.relative_to(REPO_ROOT).as_posix() for path, name in graph_files.items()}
        self.defs = {name: self._definitions(tree) for name, tree in self.trees.items()}
        self.imports = {name: self._imports(tree) for name, tree in self.trees.items()}
        self.entered: set[tuple[str, str]] = set()
        self.stops: list[tuple[str, list[str]]] = []

    @staticmethod
    def _definitions(tree: ast.Module) -> dict[str, ast.AST]:
        found = {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                found[node.name] = node
                found.update({f"{node.name}.{m.name}": m for m in getattr(node, "body", [])
                              if isinstance(node, ast.ClassDef) and isinstance(m, ast.FunctionDef)})
        return found

    def _imports(self, tree: ast.Module) -> dict[str, tuple[str, str | None]]:
        """Each imported name: (module, name), or (module, None) for a module."""
        found = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in self.trees:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found[alias.asname or alias.name] = (sub, None) if sub in self.trees else (node.module, alias.name)
        return found

    def lookup(self, module: str, name: str) -> tuple[str, str] | None:
        """The definition `name` means in `module`, following imports (and a package's re-exports)."""
        for _ in range(5):
            if name in self.defs[module]:
                return module, name
            module, name = self.imports[module].get(name, (module, None))
            if name is None:
                return None
        return None

    def callee(self, call: ast.Call, module: str, owner: str | None, types: dict) -> tuple[str, str] | None:
        func = call.func
        if isinstance(func, ast.Name):
            return self.lookup(module, func.id)
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
            return None
        base = func.value.id
        if base in self.imports[module] and self.imports[module][base][1] is None:  # a module's function
            target = self.imports[module][base][0]
            return (target, func.attr) if func.attr in self.defs[target] else None
        cls = (module, owner) if base == "self" and owner else types.get(base) or self.lookup(module, base)
        if cls and f"{cls[1]}.{func.attr}" in self.defs[cls[0]]:
            return cls[0], f"{cls[1]}.{func.attr}"
        return None

    def enter(self, module: str, qualname: str, held: set[str]) -> None:
        node = self.defs[module][qualname]
        if (module, qualname) in self.entered or not isinstance(node, ast.FunctionDef):
            return
        self.entered.add((module, qualname))
        if self.stops and self.stops[-1][0] == self.paths[module]:
            self.stops[-1][1].append(qualname)
        else:
            self.stops.append((self.paths[module], [qualname]))
        types = {}
        for arg in node.args.args + node.args.kwonlyargs:
            for name in ast.walk(arg.annotation) if arg.annotation else ():
                if isinstance(name, ast.Name) and (cls := self.lookup(module, name.id)) and \
                        isinstance(self.defs[cls[0]][cls[1]], ast.ClassDef):
                    types[arg.arg] = cls
        owner = qualname.split(".")[0] if "." in qualname else None
        for statement in node.body:
            self.visit(statement, module, owner, types, held)

    def visit(self, node: ast.AST, module: str, owner: str | None, types: dict, held: set[str]) -> None:
        """Walk `node` in the order it runs; `held` grows with each name assigned from the value."""
        def holds(expr: ast.AST) -> bool:
            return any(isinstance(n, ast.Name) and n.id in held for n in ast.walk(expr))

        def named(target: ast.AST) -> set[str]:
            return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}

        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None:
            self.visit(node.value, module, owner, types, held)
            if holds(node.value):
                for target in getattr(node, "targets", [getattr(node, "target", None)]):
                    held |= named(target)
        elif isinstance(node, (ast.For, ast.comprehension, ast.withitem)):
            source = node.context_expr if isinstance(node, ast.withitem) else node.iter
            target = node.optional_vars if isinstance(node, ast.withitem) else node.target
            self.visit(source, module, owner, types, held)
            if target is not None and holds(source):
                held |= named(target)
            for child in getattr(node, "body", []) + getattr(node, "orelse", []) + getattr(node, "ifs", []):
                self.visit(child, module, owner, types, held)
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            for child in node.generators + [getattr(node, "key", None), getattr(node, "value", None),
                                            getattr(node, "elt", None)]:
                if child is not None:
                    self.visit(child, module, owner, types, held)
        elif isinstance(node, ast.Call):
            for child in [node.func, *node.args, *(k.value for k in node.keywords)]:
                self.visit(child, module, owner, types, held)
            target = self.callee(node, module, owner, types)
            function = self.defs[target[0]][target[1]] if target else None
            if isinstance(function, ast.FunctionDef):
                params = [a.arg for a in function.args.args]
                method = "." in target[1] and params[:1] in (["self"], ["cls"])
                receiver = isinstance(node.func, ast.Attribute) and holds(node.func.value)
                handed = {params[i + method] for i, a in enumerate(node.args) if holds(a) and i + method < len(params)}
                handed |= {k.arg for k in node.keywords if k.arg and holds(k.value)}
                handed |= {params[0]} if method and receiver else set()
                if handed:
                    self.enter(*target, handed)
        else:
            for child in ast.iter_child_nodes(node):
                self.visit(child, module, owner, types, held)

    def follow(self, module: str, function: str, argument: str) -> list[tuple[str, list[str]]]:
        """The stops of `argument` handed to each call of `function` in `module`."""
        for node in ast.walk(self.trees[module]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == function:
                self.visit(node, module, None, {}, {argument})
        return self.stops


def returns(stops: list[tuple[str, list[str]]]) -> int:
    """How many stops come back to a file the route had left."""
    return len(stops) - len({path for path, _ in stops})


def test_a_resume_reads_a_checkpoint_along_one_road():
    """train.py's `restore(..., resume, ...)` followed call by call: the resume point goes down into checkpoint_io/,
    which reads every engine's files, and comes back up a few times at most (issue 61: 22 stops in 12 files, 10
    returns, before). Seen to catch: a move into a pipeline stage through DDP files in a scratch folder again
    (`ddp_files.write`, then read back as a pipeline checkpoint): 7 returns."""
    stops = Route().follow("train", "restore", "resume")
    route = "\n".join(f"{path}: {', '.join(functions)}" for path, functions in stops)
    assert returns(stops) <= RESTORE_RETURNS_ALLOWED, route
    said = re.search(r"comes back\s+to a file it left (\d+) times", (REPO_ROOT / "docs/architecture.md").read_text())
    assert said is not None and int(said.group(1)) == returns(stops), route  # the page states the count
    # The route is walked whole: every engine's reader is on it, and none outside checkpoint_io/.
    files = {path for path, _ in stops}
    assert {f"checkpoint_io/{name}_files.py" for name in ("ddp", "fsdp", "zero")} <= files, route
    assert returns([("a", []), ("b", []), ("a", []), ("c", []), ("b", [])]) == 2


def test_model_reads_no_engine_format_itself():
    """`GPT.from_pretrained` reads a checkpoint of any engine through `checkpoint_io.reader`. No module of model/
    imports an engine module of checkpoint_io/, a library that reads an engine's files, or a name of the files an
    engine lays out (those checkpoint_io's engine modules import from common.run_dir). Seen to catch: model/pretrained
    merging FSDP2's shards itself again (`from torch.distributed.checkpoint.format_utils import dcp_to_torch_save`)."""
    engine_modules = [path for path in package_files("checkpoint_io") if path.name.endswith("_files.py")]
    engine_files = {alias.name for path in engine_modules for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom) and node.module == "common.run_dir" for alias in node.names}
    assert {"MODEL_WEIGHTS", "FSDP_MODEL_DIR", "DEEPSPEED_DIR"} <= engine_files  # the check reads real names
    readers = tuple(f"checkpoint_io.{path.stem}" for path in engine_modules) + ENGINE_LIBRARIES
    found = []
    for path in package_files("model"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {alias.name for alias in node.names}
                modules = [node.module] + [f"{node.module}.{name}" for name in names]
                if any(m == r or m.startswith(f"{r}.") for m in modules for r in readers) or (
                        node.module == "common.run_dir" and names & engine_files):
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: from {node.module} import {names}")
            elif isinstance(node, ast.Import):
                found += [f"{path.relative_to(REPO_ROOT)}:{node.lineno}: import {a.name}" for a in node.names
                          if a.name.startswith(readers)]
    assert found == []


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
    r"comes back\s+to a file it left (\d+) times":
        "test_architecture.py::test_a_resume_reads_a_checkpoint_along_one_road",
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
