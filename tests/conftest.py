"""Shared test setup: everything runs offline, on the CPU, with the repo root importable.

The helpers every end-to-end test uses (a tiny model's flags, `launch` for a train.py run, in this process where
the claim allows, `resume_copy` for a feature's resume, weight and metric comparisons, bit for bit or to float
rounding with the bounds of tests/bounds.py, `run_in_process` for a refusal) and the reference runs
(`uninterrupted`, `single_run`, `ddp_run`; `quick_start`, the README's own) and tiny HF GPT-2 folder (`tiny_hf_gpt2`),
which are built once per pytest session and shared by every file that compares against them; `project_files`, the
project's own files for the tests that read the code (never a virtual environment or a run's output inside the
clone); and the hooks of the tiers (tests/tiers.py), of each test's CPU-seconds (tests/cpu_costs.py) and of xdist's
groups. Plain helpers are imported as `from conftest import ...`; fixtures are found by name.

Under pytest-xdist the session fixtures are built once for all workers: the first worker to need one builds it
under a file lock in the session's shared temporary folder, the others wait and reuse it (`shared_once`).
"""
from __future__ import annotations

import atexit
import fnmatch
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

# Set before any test imports transformers/datasets/wandb: nothing may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# trackio keeps every run in one folder, read when it is imported (default ~/.cache/huggingface/trackio): the tests'
# runs, and the processes they start, use a folder of this session's, removed at its end, never the user's.
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="pytest-trackio-")
atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], ignore_errors=True)
# This project's cache (common/cache_dir.py: the HF tokenizer files an export copies) is one of the process's own,
# shared with the processes it starts, so that the tests build it as a new machine does, and never use the user's.
os.environ["GPT2_ACCELERATE_CACHE"] = tempfile.mkdtemp(prefix="pytest-gpt2-accelerate-cache-")
atexit.register(shutil.rmtree, os.environ["GPT2_ACCELERATE_CACHE"], ignore_errors=True)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`-n 2` or `-n 3`, the README's commands) each worker gets one thread, for
# its in-process tests and the processes it starts, as the end-to-end runs already have (launch sets it), rather
# than every worker's torch spreading over every core.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import cpu_costs  # noqa: E402
import pytest  # noqa: E402
import tiers  # noqa: E402
from bounds import GRAD_NORM_RTOL, LOSS_RTOL, SIGNAL_ATOL, weights_apart_by_rounding  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
# The repo's packages, and the scripted ranks of the distributed evaluation tests (tests/fixtures/eval/fake_ranks.py).
for folder in (REPO_ROOT, REPO_ROOT / "tests" / "fixtures" / "eval"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
# train.py's flags as train.py reads them, in every test whatever it imports: the registered evaluations' and
# optimizers' own flag groups (`--eval_every`, `--muon_lr`) join the parser when their registries are imported.
import training.evaluations.registry  # noqa: E402, F401
import training.optimizers.registry  # noqa: E402, F401

# ---- the project's own files ---------------------------------------------------------------------------------

# Top-level folders that are never the project's, whatever git says: virtual environments (the README's Quick start
# makes .venv/ inside the clone; `python -m venv venv` is as common) and what runs and builds write. .gitignore
# names most of them as well; they are listed here too because git lists a user's venv/, which .gitignore does not
# name, as the project's own untracked files, and because a tarball has no git to ask.
NOT_THE_PROJECTS = frozenset({".git", ".venv", "venv", "out", "shards", "build", "runs", "wandb"})


def project_files(root: Path = REPO_ROOT, suffix: str = "") -> list[Path]:
    """The project's own files under `root` whose names end in `suffix`, sorted. The tests that read the code (its
    imports, its names) read these, never a virtual environment or a run's output inside the clone, whose files are
    not the project's and need not even be UTF-8 (issue 36).

    In a git clone: what git tracks and the untracked files it does not ignore (`git ls-files --cached --others
    --exclude-standard`: a new file counts before it is committed, a deleted one no longer does). Without git (a
    tarball): every file less what .gitignore names. Either way, never the NOT_THE_PROJECTS folders."""
    listed = _git_files(root)
    files = _walked_files(root) if listed is None else listed
    return sorted({p for p in files if p.name.endswith(suffix) and p.relative_to(root).parts[0] not in NOT_THE_PROJECTS
                   and p.is_file()})


def _git_files(root: Path) -> list[Path] | None:
    """git's list of the project's files, or None where `root` is not the top of a git work tree: no git installed,
    or a tarball unpacked inside some other repository (whose rules are not the project's)."""
    def git(*args: str) -> subprocess.CompletedProcess:
        # Names as the file system has them, even where they are not UTF-8 (as Python's own os functions do).
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, encoding="utf-8",
                              errors="surrogateescape")

    try:
        top = git("rev-parse", "--show-toplevel")
    except FileNotFoundError:
        return None
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root.resolve():
        return None
    listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard")  # -z: names as they are, unquoted
    assert listed.returncode == 0, listed.stderr
    return [root / name for name in listed.stdout.split("\0") if name]


def _walked_files(root: Path) -> list[Path]:
    """Every file under `root` less what its .gitignore names, read in the forms this project's .gitignore uses:
    names and globs, a leading or inner `/` anchoring to the root, a trailing `/` for folders only (`!` lines are
    not read). The NOT_THE_PROJECTS folders are not entered (a .venv holds tens of thousands of files)."""
    gitignore = root / ".gitignore"
    lines = gitignore.read_text(encoding="utf-8").splitlines() if gitignore.is_file() else []
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith(("#", "!"))]

    def ignored(relative: str, is_dir: bool) -> bool:
        for pattern in patterns:
            if pattern.endswith("/") and not is_dir:
                continue
            glob = pattern.strip("/")
            name = relative if "/" in pattern.rstrip("/") else relative.rsplit("/", 1)[-1]
            if fnmatch.fnmatchcase(name, glob):
                return True
        return False

    found = []
    for folder, dirs, names in os.walk(root):
        here = Path(folder).relative_to(root)
        dirs[:] = [d for d in dirs if not (here == Path(".") and d in NOT_THE_PROJECTS)
                   and not ignored((here / d).as_posix(), is_dir=True)]
        found += [Path(folder) / n for n in names if not ignored((here / n).as_posix(), is_dir=False)]
    return found


def _ephemeral_ports_start() -> int:
    """The first port of the kernel's range for outgoing connections (Linux; 32768, its default, elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORTS_BELOW = _ephemeral_ports_start()
_handed_out: set[int] = set()


def free_port() -> int:
    """A port nobody listens on, for the rendezvous of a multi-process test, and that nothing else will take before
    the launch binds it a few seconds later.

    Drawn below the kernel's ephemeral range: a port the kernel hands out (bind to port 0) is one it may hand out
    again to any outgoing connection meanwhile, and gloo opens many (seen: EADDRINUSE on torchrun's store while
    4-process tests ran on the other xdist worker). Each xdist worker draws from its own slice of the range below,
    and never hands out the same port twice, so two tests cannot be given one port either."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    low = 10_000
    width = max(100, (_PORTS_BELOW - low) // 8)  # 8 slices: up to 8 xdist workers
    start = low + (worker % 8) * width
    for port in range(start, start + width):
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))  # all interfaces, as torch's store binds
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {start}-{start + width - 1}")


# ---- the tiny run ----------------------------------------------------------------------------------------

# A tiny model: the point is the loop's bookkeeping, not learning.
# AdamW: its 2-process run equals the 1-process run to 1e-6 (torch's Muon orthogonalises in bf16: tests/test_muon.py)
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--val_tokens", "256",
        "--eval_batch_size", "4", "--sample_tokens", "4", "--lr", "3e-3", "--warmup_steps", "2", "--optimizer", "adamw"]

HELLASWAG = str(REPO_ROOT / "tests" / "fixtures" / "eval" / "hellaswag_tiny.jsonl")
# Evaluations at step 3 (between checkpoints) must not disturb the RNG streams that resume restores.
RESUME_ARGS = TINY + ["--max_steps", "6", "--micro_batch_size", "2", "--total_batch_size", "128",
                      "--save_every", "2", "--log_every", "1", "--eval_every", "3", "--dropout", "0.1",
                      "--hellaswag_every", "3", "--hellaswag_data", HELLASWAG]

# lr 1e-3: Adam turns float-rounding noise in near-zero gradients (the key biases, whose exact gradient
# is 0) into updates of ~lr * 1e-3, so a larger lr would push those differences past 1e-6.
DDP_ARGS = TINY + ["--max_steps", "4", "--micro_batch_size", "2", "--total_batch_size", "256",
                   "--save_every", "2", "--log_every", "1", "--eval_every", "2", "--lr", "1e-3"]


def launch(args: list[str], nproc: int = 1, fault: str | None = None, check: bool = True,
           background: bool = False, grad_accum: int = 1, extra_env: dict[str, str] | None = None,
           engine: str | None = None, mixed_precision: str = "no", launcher_args: tuple[str, ...] = ()):
    """Run tests/fault_train.py (train.py plus an optional injected fault) in 1 or 2 processes. `engine`: a config
    of accelerate_configs/ (e.g. "zero2_8gpu") launched as `nproc` processes on this CPU through tests/engine_shim.py,
    in `mixed_precision` ("no": fp32); by default a multi-process launch is DDP on gloo (cpu_2proc.yaml).
    `launcher_args`: more flags of `accelerate launch` (e.g. --max_restarts 1).

    One process that must succeed, with no fault and no environment of its own but accelerate's (a reference run, a
    resume; `ACCELERATE_MIXED_PRECISION`, read when the run starts), runs in this pytest process (`train_in_process`:
    the same entry point, without a new interpreter's 4-5 s of imports); a fault, a background run, an exit status
    the test reads (`check=False`), another environment (the Hub's, read when huggingface_hub is imported), an
    engine or several processes start real processes."""
    accelerates_own = all(key.startswith("ACCELERATE_") for key in extra_env or {})  # read when the run starts
    if nproc == 1 and engine is None and fault is None and check and not background and accelerates_own \
            and not launcher_args:
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(REPO_ROOT)  # where a launched process runs
            for key, value in (extra_env or {}).items():
                mp.setenv(key, value)
            stdout, stderr = train_in_process(args)
        return subprocess.CompletedProcess(["train.py", *args], 0, stdout, stderr)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GRAD_ACCUM": str(grad_accum),
           **(extra_env or {})}
    env.pop("FAULT", None)
    if fault:
        env["FAULT"] = fault
    script = str(REPO_ROOT / "tests" / "fault_train.py")
    if nproc == 1 and engine is None:
        cmd = [sys.executable, script, *args]
    else:
        config = engine or "cpu_2proc"
        if engine is not None:
            env.setdefault("ENGINE_SHIM", "1")  # extra_env may turn it off: accelerate as shipped
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO_ROOT / "accelerate_configs" / f"{config}.yaml"), "--num_processes", str(nproc),
               "--mixed_precision", mixed_precision, "--main_process_port", str(free_port()), *launcher_args, script,
               *args]
    if background:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def final_weights(out_dir: Path):
    from safetensors.torch import load_file

    return load_file(out_dir / "final" / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    """The final weights of two runs, bit for bit: a resume against the run it continues, on the same processes."""
    import torch

    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), f"{name} differs (max {(wa[name] - wb[name]).abs().max():.3g})"


def assert_weights_within_rounding(a: Path, b: Path, atol: float = SIGNAL_ATOL) -> None:
    """The final weights of two AdamW runs that sum the same gradients in another order (other process counts,
    engines, nodes, tensor parallelism): the elements whose gradients carry signal to `atol`, a rare few and the
    key biases to AdamW's own bound (the lr, betas and steps of run `a`'s config.yaml). tests/bounds.py says why
    on every CPU kind, and what a bug looks like instead. `atol` larger only for runs in another precision."""
    import yaml

    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    problems = weights_apart_by_rounding(wa, wb, yaml.safe_load((a / "config.yaml").read_text()), atol)
    more = f"; and {len(problems) - 3} tensors more" if len(problems) > 3 else ""
    assert not problems, "; ".join(problems[:3]) + more


def resume_copy(reference: Path, step: int, out: Path) -> list[str]:
    """The flags that resume a copy of the finished run `reference`, made at `out`, from its own checkpoint of
    `step`: the run's later checkpoints and final/ are set aside when it starts (training.checkpoints.resume), as for a
    user who
    resumes an older checkpoint. Ending bit for bit where `reference` ended is the proof that a feature's checkpoint
    holds everything its run needs: one launch, where a run killed and resumed takes two. Whether a kill at any
    moment leaves such a checkpoint behind is the checkpointing's own claim, the same under every feature, proven
    on one process and on two (test_train, test_resume_paths)."""
    shutil.copytree(reference, out)
    return ["--out_dir", str(out), "--resume", str(out / "checkpoints" / f"step_{step:06d}")]


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_metrics(a: Path, b: Path) -> None:
    """What two runs equal to float rounding logged (`assert_weights_within_rounding`'s runs): the same steps and
    tokens; loss and validation loss to LOSS_RTOL, the gradient norm to GRAD_NORM_RTOL (tests/bounds.py says why);
    HellaSwag's accuracies equal (they count items, and rounding would flip one only where two endings' scores lie
    within about 1e-6 of each other)."""
    x, y = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in y] == [m["step"] for m in x]
    for m, n in zip(x, y):
        assert n["tokens"] == m["tokens"]
        assert n["loss"] == pytest.approx(m["loss"], rel=LOSS_RTOL, abs=0), m["step"]
        assert n["grad_norm"] == pytest.approx(m["grad_norm"], rel=GRAD_NORM_RTOL, abs=0), m["step"]
        for key in ("val_loss", "hellaswag_acc", "hellaswag_acc_norm"):
            assert (key in m) == (key in n), (key, m["step"])
            if key == "val_loss" and key in m:
                assert n[key] == pytest.approx(m[key], rel=LOSS_RTOL, abs=0), m["step"]
            elif key in m:
                assert n[key] == m[key], (key, m["step"])


def tree_digest(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_in_process(monkeypatch, capsys, args: list[str]) -> str:
    """train.py's entry point in this process; returns the error line it printed."""
    import train

    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        train.run_cli(train.main)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def train_in_process(args: list[str]) -> tuple[str, str]:
    """A whole train.py run in this process, through its entry point (`train.run_cli(train.main)`), for the tests
    whose claim is about what a run does with its folder rather than about its process (signals, kills, exit
    codes, several processes: those use `launch`). It saves a new interpreter's start and its imports of torch,
    transformers and accelerate, seconds each time. It runs on one thread, as a launched process does (`launch` sets
    OMP_NUM_THREADS=1), so that its sums are those of the processes it is compared with, bit for bit.
    Returns stdout and stderr; a run that does not exit 0 fails the test with its output."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    import torch

    import train

    stdout, stderr = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(stdout), redirect_stderr(stderr):
        mp.setattr(sys, "argv", ["train.py", *args])
        torch.set_num_threads(1)
        fresh_accelerate_state()
        try:
            train.run_cli(train.main)
        except SystemExit as exit_info:
            if exit_info.code not in (0, None):
                raise AssertionError(f"exit {exit_info.code}\n{stdout.getvalue()[-3000:]}\n"
                                     f"{stderr.getvalue()[-5000:]}") from None
        finally:
            torch.set_num_threads(threads)
            fresh_accelerate_state()
    return stdout.getvalue(), stderr.getvalue()


def fresh_accelerate_state() -> None:
    """accelerate's process-wide state (precision, plugins, accumulation) as a new interpreter has it: an in-process
    run neither inherits an earlier one's nor leaves its own to the next test. accelerate's own tests reset it so."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# ---- built once per session --------------------------------------------------------------------------------

def shared_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name`, built by `build(folder)` once per pytest session. Under pytest-xdist every worker has
    a temporary folder of its own inside the session's; the folder is built there, in the parent, under a file
    lock, by whichever worker needs it first, and the others reuse it (xdist's documented pattern). A build that
    fails leaves no `.done` mark, so the next worker to ask builds again and fails with its own error."""
    from filelock import FileLock

    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        root = tmp_path_factory.getbasetemp()
    else:
        root = tmp_path_factory.getbasetemp().parent  # this session's, shared by its workers
    folder, done = root / "shared" / name, root / "shared" / f"{name}.done"
    done.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "shared" / f"{name}.lock")):
        if not done.exists():
            if folder.exists():  # a failed earlier attempt
                shutil.rmtree(folder)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> Path:
    """The reference: RESUME_ARGS, 6 steps with dropout (so the RNG state matters), accumulation 2, no
    interruption; HellaSwag and validation at step 3, between the checkpoints of steps 2, 4 and 6. Shared by
    test_train, test_ctrl_c and test_resume_paths; tests only read it (copy it to change it)."""
    return shared_once(tmp_path_factory, "uninterrupted",
                       lambda folder: launch(RESUME_ARGS + ["--out_dir", str(folder / "run")])) / "run"


def probed_run(tmp_path_factory: pytest.TempPathFactory, name: str, args: list[str], engine: str,
               nproc: int = 2) -> Path:
    """`args` on `nproc` processes of the accelerate config `engine` (through tests/engine_shim.py), built once per
    session: the run in folder/run, and in folder/probe what each rank held at its checkpoints (the shim's probe:
    the evidence that an engine shards, and how)."""
    def build(folder: Path) -> None:
        (folder / "probe").mkdir()
        launch(args + ["--out_dir", str(folder / "run")], nproc=nproc, engine=engine,
               extra_env={"ENGINE_PROBE": str(folder / "probe")})

    return shared_once(tmp_path_factory, name, build)


@pytest.fixture(scope="session")
def single_run(tmp_path_factory) -> Path:
    """DDP_ARGS on one process (accumulation 4): the reference every multi-process run of DDP_ARGS is held against
    (test_train's DDP, test_engines, test_tensor_parallel, test_activation_checkpointing); its output beside it, in
    ../output.txt; read only."""
    def build(folder: Path) -> None:
        proc = launch(DDP_ARGS + ["--out_dir", str(folder / "run")])
        (folder / "output.txt").write_text(proc.stdout + proc.stderr)  # what it printed, for the tests to read

    return shared_once(tmp_path_factory, "single", build) / "run"


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory) -> Path:
    """DDP_ARGS on 2 processes: 2 processes x accumulation 2 x micro-batch 2 x 32 tokens = 256 tokens per step.
    Shared by test_train, test_ctrl_c and test_gpu_paths_on_cpu; read only."""
    return shared_once(tmp_path_factory, "ddp",
                       lambda folder: launch(DDP_ARGS + ["--out_dir", str(folder / "run")], nproc=2)) / "run"


# The xdist group of the tests that read `quick_start`: one worker builds it and runs them all, while the other goes on
# with the rest of the suite, instead of waiting on the file lock for the minute it takes.
QUICK_START_GROUP = "quick_start"


@pytest.fixture(scope="session")
def quick_start(tmp_path_factory) -> Path:
    """The README's Quick start training as written: `python train.py`, a process of its own, in a folder laid out as
    a clone (the project's top-level files and folders, linked), where it leaves out/shakespeare. Returns that
    folder; what the run printed is beside it, in ../output.txt. About a minute on 2 cores: the one run of the
    default recipe in the suite. Read only: `after_quick_start` copies it for a test that changes it."""
    def build(folder: Path) -> None:
        clone = folder / "clone"
        clone.mkdir()
        for name in sorted({path.relative_to(REPO_ROOT).parts[0] for path in project_files()}):
            (clone / name).symlink_to(REPO_ROOT / name)
        proc = subprocess.run([sys.executable, "train.py"], cwd=clone, capture_output=True, text=True, timeout=1200,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        (folder / "output.txt").write_text(proc.stdout + proc.stderr)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    return shared_once(tmp_path_factory, "quick_start", build) / "clone"


def after_quick_start(quick_start: Path, to: Path) -> Path:
    """A copy of the `quick_start` clone at `to` (its links to the project, its own out/), for a test to change."""
    shutil.copytree(quick_start, to, symlinks=True)
    return to


@pytest.fixture(scope="session")
def tiny_hf_gpt2(tmp_path_factory) -> Path:
    """A random tiny GPT-2 saved by transformers (seed 0; 2 layers, 2 heads, 32 wide, 64 positions): the base of
    the fine-tuning and LoRA tests and the `gpt2` of the loopback Hub. Read only."""
    def build(folder: Path) -> None:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        with torch.random.fork_rng():
            torch.manual_seed(0)
            GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2)).save_pretrained(folder)

    return shared_once(tmp_path_factory, "tiny_hf_gpt2", build)


# ---- the tiers (tests/tiers.py), CPU-seconds (tests/cpu_costs.py) and pytest-xdist --------------------------------

def pytest_configure(config: pytest.Config) -> None:
    tiers.pytest_configure(config)
    config.pluginmanager.register(cpu_costs.CpuCosts(), "cpu_costs")


pytest_runtest_protocol = tiers.pytest_runtest_protocol
pytest_runtest_makereport = tiers.pytest_runtest_makereport
pytest_runtest_logreport = tiers.pytest_runtest_logreport
pytest_terminal_summary = tiers.pytest_terminal_summary


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks (conftest.py loads before it)
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` (the README's command), the tests that use a module-scoped fixture of their file (a
    run of that file's own, a loopback Hub) go to one worker together, so that it is built once, as without
    xdist; every other test goes to whichever worker is free. The session fixtures above are shared by their
    file lock instead. Without xdist the mark does nothing. Before that, the marks of the tiers are checked.

    tryfirst: pytest loads this conftest (the testpaths') before xdist's worker plugin, so without it xdist names
    the groups first and sees no mark: each module fixture was then built once per worker that ran one of its tests
    (seen 2026-11-26: the two-node SLURM job, the elastic reference, the LoRA reference, the acceptance smoke run,
    twice each)."""
    tiers.pytest_collection_modifyitems(config, items)
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        if fixtures is None:
            continue
        scopes = {d.scope for defs in fixtures.name2fixturedefs.values() for d in defs}
        if scopes & {"module", "class", "package"}:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
