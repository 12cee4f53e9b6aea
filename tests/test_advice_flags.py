"""Every piece of advice a CLI prints names a flag that CLI has.

For each command-line entry point, the `--flags` written in the string literals of the modules it runs (its
own file and every project module it imports, however indirectly and lazily) are checked against the flags
its parser accepts (read from its `--help`). Flags that belong to another program (`accelerate launch`, pip)
are listed below with the reason; a shared module that advises a caller-specific flag takes it as a parameter.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

# entry point -> its module path (train.py is the script)
CLIS = ["train", "eval.hellaswag", "eval.val_loss", "eval.harness", "model.sample", "data.prepare", "publish.hub",
        "publish.card"]
# Flags of other programs that the advice names, and why they are not the CLI's own.
OTHER_PROGRAMS = {
    "--config_file": "accelerate launch", "--num_processes": "accelerate launch", "--mixed_precision":
    "accelerate launch", "--multi_gpu": "accelerate launch", "--main_process_port": "accelerate launch",
    "--dynamo_backend": "accelerate launch", "--cpu": "accelerate launch", "--num_machines": "accelerate launch",
    "--machine_rank": "accelerate launch", "--main_process_ip": "accelerate launch",
    "--batch": "scancel", "--signal": "sbatch/scancel", "--requeue": "sbatch",
}
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9_]*[a-z0-9])(?![\w-])")
# A message that names a command (`python -m data.prepare ... --out X`) advises that command's flags.
COMMAND = re.compile(r"python (?:-m )?(train(?:\.py)?|eval\.\w+|model\.sample|data\.prepare|publish\.\w+)")
# Modules whose errors arise under some of the CLIs that import them only: the CLIs they speak to.
SCOPE = {
    "configs/": {"train"},  # the training config's checks; the other CLIs read a run's config.yaml, never parse it
    "training/": {"train"},
    "planner/": {"train"},  # train.py --plan (benchmarks.memory_plan passes its own spelling of the settings)
    "publish/hub.py": {"publish.hub"},  # train.py imports it for its pushes, whose errors name no flag
    "publish/card.py": {"publish.card"},
    "eval/common.py": {"eval.hellaswag", "eval.val_loss", "eval.harness"},  # --device: the evaluation CLIs'
    "model/lora.py": {"train"},  # the adapters' settings, checked when a run adds them
    "data/pairs.py": {"train"},  # the training loaders' resume checks
    "data/strided.py": {"train"},
    "data/streaming.py": {"train", "eval.val_loss"},
    # --dataset and its settings: parsed by a run, data.prepare and the validation loss (the card's reading of a
    # run's dataset turns a refusal into "name it as written")
    "data/": {"train", "data.prepare", "eval.val_loss"},
}


def module_file(name: str) -> Path:
    return REPO_ROOT / ("train.py" if name == "train" else name.replace(".", "/") + ".py")


def project_modules_run_by(name: str) -> set[Path]:
    """`name`'s file and every project file it imports, however indirectly (imports inside functions too)."""
    seen, todo = set(), [module_file(name)]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] + [f"{node.module}.{a.name}" for a in node.names] \
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for dotted in names:
                for candidate in (REPO_ROOT / (dotted.replace(".", "/") + ".py"),
                                  REPO_ROOT / dotted.replace(".", "/") / "__init__.py"):
                    if candidate.is_file():
                        todo.append(candidate)
    return seen


def advised_flags(path: Path) -> list[tuple[str, str | None]]:
    """(flag, the command the message names, if any) for the `--flags` in the one-line errors a file raises (the
    text of its `UserError(...)` calls)."""
    found = []
    for call in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", None)) == "UserError":
            text = " ".join(n.value for n in ast.walk(call) if isinstance(n, ast.Constant) and isinstance(n.value, str))
            named = COMMAND.search(text)
            command = named and named.group(1).removesuffix(".py")
            found += [(f"--{m}", command) for m in FLAG.findall(text[named.end():] if named else text)]
            found += [(f"--{m}", None) for m in FLAG.findall(text[:named.start()])] if named else []
    return found


def scope(path: Path) -> set[str] | None:
    relative = path.relative_to(REPO_ROOT).as_posix()
    return next((clis for prefix, clis in SCOPE.items() if relative.startswith(prefix)), None)


def accepted_flags(name: str) -> set[str]:
    """The flags in `name`'s --help."""
    module = importlib.import_module(name)
    out = io.StringIO()
    argv = sys.argv
    try:
        sys.argv = [name, "--help"]
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            module.main() if name in ("train", "data.prepare") else module.main(["--help"])
    finally:
        sys.argv = argv
    return {f"--{m}" for m in FLAG.findall(out.getvalue())} | {"--help"}


@pytest.fixture(scope="module")
def accepted() -> dict[str, set[str]]:
    return {cli: accepted_flags(cli) for cli in CLIS}


@pytest.mark.parametrize("cli", CLIS)
def test_every_flag_the_advice_names_exists(cli, accepted):
    """Every `--flag` named in the one-line errors a CLI can raise (its modules, reached through imports, lazy ones too)
    is one its `--help` lists, or one of the command the message names.

    Seen to catch: the old HellaSwag advice (`--data` inside train.py) restored: fails naming
    `eval/hellaswag_data.py`."""
    wrong = {}
    for path in sorted(project_modules_run_by(cli)):
        if (clis := scope(path)) is not None and cli not in clis:
            continue
        for flag, command in advised_flags(path):
            if flag not in accepted[command or cli] and flag not in OTHER_PROGRAMS:
                where = path.relative_to(REPO_ROOT).as_posix() + (f" ({command})" if command else "")
                wrong.setdefault(flag, set()).add(where)
    assert not wrong, f"python -m {cli}: its modules advise flags it has not: {wrong}"


def test_the_check_sees_a_wrong_flag(tmp_path, monkeypatch):
    """The known case: HellaSwag's advice named eval.hellaswag's --data inside train.py, whose flag is
    --hellaswag_data."""
    bad = tmp_path / "bad.py"
    bad.write_text('raise UserError("offline; pass a local HellaSwag jsonl with --data")\n')
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    assert advised_flags(bad) == [("--data", None)]
    assert "--data" not in accepted_flags("train")


def test_hellaswag_advice_offline_names_the_callers_flag():
    from common.errors import UserError
    from eval.hellaswag_data import load_items

    with pytest.raises(UserError, match="pass a local HellaSwag jsonl with --hellaswag_data"):
        load_items(None, flag="--hellaswag_data")  # as the evaluations runner calls it; the Hub is offline here
