"""What a launch says before train.py trains: the user's own command lines, through accelerate's real launcher
where the claim is about its output (marked slow), in process where the claim is about train.py's answer.

A core install (no DeepSpeed) is simulated by tests/core_install/ on PYTHONPATH (its sitecustomize hides the
installed DeepSpeed from every process of the launch, the launcher's too).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, TINY

CORE_INSTALL = str(REPO_ROOT / "tests" / "core_install")
CONFIGS = REPO_ROOT / "accelerate_configs"


def _core_install_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (CORE_INSTALL, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


# accelerate's launcher (accelerate/commands/launch.py, deepspeed_launcher) checks for DeepSpeed before it starts any
# process, and its ImportError is the last line the user reads.
ACCELERATES_LINE = "ImportError: DeepSpeed is not installed => run `pip3 install deepspeed` or build it from source."


@pytest.mark.slow
def test_a_zero_config_on_a_core_install_stops_in_accelerates_launcher_before_train_py(tmp_path):
    """docs/install.md's claim for a ZeRO config without DeepSpeed: accelerate's launcher stops it, exit 1, its last
    line naming the install, and train.py never starts (no run folder). No config of ours can reach train.py first: a
    DEEPSPEED config always goes through that check, and only it tells the processes their ZeRO settings.

    Seen to catch: not broken on purpose: this is accelerate's behaviour, held so that the docs stay true."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "zero2_8gpu.yaml"),
         "train.py", *TINY, "--max_steps", "2", "--out_dir", str(out)],
        cwd=REPO_ROOT, env=_core_install_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ACCELERATES_LINE
    assert not out.exists()


@pytest.mark.slow
def test_a_deepspeed_process_on_a_core_install_is_one_line(tmp_path):
    """A process told by its environment that it runs under DeepSpeed (a launcher other than accelerate's, such as
    torchrun with accelerate's variables set by hand) on a core install: train.py's one line, not accelerate's
    traceback from inside the Accelerator.

    Seen to catch: `deepspeed_missing` made to answer None: accelerate's traceback from `start_accelerator`."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", *TINY, "--max_steps", "2", "--out_dir", str(out)],
                          cwd=REPO_ROOT, env=_core_install_env(ACCELERATE_USE_DEEPSPEED="true"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        'error: the accelerate config asks for DeepSpeed, which is not installed; pip install -e ".[deepspeed]" '
        "(or use a DDP or FSDP config)"]
    assert not out.exists()


# ---- every shipped config on this CPU: the rule (training/distributed/machine.py), in process
# -----------------------------

def launched_environment(config_args: list[str]) -> dict[str, str]:
    """What each process of `accelerate launch <config_args> train.py` finds in its environment, from accelerate's
    own launcher code (accelerate/commands/launch.py `launch_command`'s choice of launcher, and its `prepare_*`
    functions), plus what torch's elastic agent adds for a rank (WORLD_SIZE, LOCAL_WORLD_SIZE, RANK 0). The
    accelerate variables only; no process is started."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args([*config_args, "train.py"]))
    if args.use_deepspeed and not args.cpu:
        args.deepspeed_fields_from_accelerate_config = ""
        env, agent = prepare_deepspeed_cmd_env(args)[1], True
    elif (args.use_fsdp or args.multi_gpu) and not args.cpu:
        env, agent = prepare_multi_gpu_env(args), True
    else:
        env, agent = prepare_simple_launcher_cmd_env(args)[1], False
    env = {key: value for key, value in env.items()
           if os.environ.get(key) != value and (key.startswith(("ACCELERATE_", "MASTER_")))}
    if agent:
        env.update(WORLD_SIZE=str(args.num_processes), LOCAL_WORLD_SIZE=str(args.num_processes // args.num_machines),
                   RANK="0", LOCAL_RANK="0")
    return env




def outcome(monkeypatch, env: dict[str, str], machine) -> str:
    """What train.py does with a launch of `env` on `machine`, up to the opened group: 'refused: <line>', or
    'runs: <the header's line>' ('runs: -' with no line). A FSDP or DeepSpeed launch on a machine without a GPU
    comes up as lone ranks (accelerate 1.15, measured: ../shared/notes/engines-on-cpu.md)."""
    from common.errors import UserError
    from training.distributed.engines import check_world_size, refuse_engine_on_cpu
    from training.distributed.machine import Asked, check_launch, runs_here

    for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    asked = Asked.of_environment()
    try:
        check_launch(asked, machine)
        refuse_engine_on_cpu()
        check_world_size(asked.processes, 1 if asked.engine != "ddp" and not machine.gpus else asked.processes)
    except UserError as err:
        return f"refused: {err}"
    return f"runs: {runs_here(asked, machine) or '-'}"


_ON_GLOO = "runs: no GPU on this machine: {} processes on the CPU over gloo"
_GPU_OPTIONS = "bf16 on the CPU, torch.compile (inductor) on the CPU"
_NO_GPU = "refused: the accelerate config asks for {}, and this machine has no GPU; DeepSpeed and FSDP run on GPUs"
# Every shipped config (and the issue's `--cpu --num_processes 2`), launched on a 2-core machine without a GPU.
ON_THIS_CPU = {
    "8gpu": _ON_GLOO.format(8) + f", 8 processes on this machine's 2 cores, {_GPU_OPTIONS}",
    "cpu_2proc": _ON_GLOO.format(2),
    "single_gpu": f"runs: no GPU on this machine: {_GPU_OPTIONS}",
    # its processes start once node 1 joins (torch's rendezvous waits for it before train.py runs)
    "multinode_2x8": _ON_GLOO.format(16) + f", 8 processes on this machine's 2 cores, {_GPU_OPTIONS}",
    "fsdp_8gpu": _NO_GPU.format("FSDP"),  # before accelerate brings its ranks up alone (and DeepSpeed builds its op)
    **{f"zero{stage}_8gpu": _NO_GPU.format("DeepSpeed") for stage in (1, 2, 3)},
    "--cpu --num_processes 2": "refused: accelerate launch started 1 process where several were asked",
    "--mixed_precision fp16": "refused: the launch asks for fp16 mixed precision, which needs a GPU",
}


def _config_args(name: str) -> list[str]:
    return name.split() if name.startswith("--") else ["--config_file", str(CONFIGS / f"{name}.yaml")]


def test_every_shipped_config_is_covered():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == {n for n in ON_THIS_CPU if not n.startswith("--")}


@pytest.mark.parametrize("name", list(ON_THIS_CPU))
def test_every_launch_on_a_cpu_says_what_it_runs_or_refuses(monkeypatch, name):
    """Every launch says what it runs, or refuses (`training/distributed/machine.py`): every shipped accelerate config
    (`test_every_shipped_config_is_covered`), and `--cpu --num_processes 2`, `--mixed_precision fp16`, with the
    environment accelerate's own launcher code gives its processes, on a 2-core machine without a GPU and on an 8-GPU
    one.

    Seen to catch: each alone: `several_in_one` forced False (`[--cpu --num_processes 2]` fails); the fp16 refusal
    removed (`[--mixed_precision fp16]`); `runs_here` answering None (`[8gpu]`, `[cpu_2proc]`, `[single_gpu]`,
    `[multinode_2x8]`)."""
    from training.distributed.machine import Machine

    env = launched_environment(_config_args(name))
    assert outcome(monkeypatch, env, Machine(gpus=0, cores=2)).startswith(ON_THIS_CPU[name])
    assert outcome(monkeypatch, env, Machine(gpus=8, cores=16)) == (
        "refused: accelerate launch started 1 process where several were asked (accelerate's single-process "
        "launcher, which --cpu and a config without a multi-process distributed_type pick, starts one whatever "
        "--num_processes says); launch several with --config_file accelerate_configs/cpu_2proc.yaml, or "
        "--multi_gpu --num_processes N without --cpu (train.py puts them on the CPU by itself); if MASTER_PORT "
        "comes from your own environment, unset it" if name == "--cpu --num_processes 2" else "runs: -")


# ---- the real launchers: one launch per mechanism --------------------------------------------------------------

def _accelerate_launch(launcher_args: list[str], run_args: list[str]) -> subprocess.CompletedProcess:
    from conftest import free_port

    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *launcher_args, "--main_process_port",
                           str(free_port()), "train.py", *TINY, "--max_steps", "2", *run_args],
                          cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_the_cpu_flag_with_several_processes_is_refused_before_anything_is_built(tmp_path):
    """The issue's `accelerate launch --cpu --num_processes 2 train.py`: one line, nothing written. accelerate's
    single-process launcher then raises its own CalledProcessError (exit 1, its traceback after the line), unless
    told --quiet (-q), which ends the launch on the line.

    Seen to catch: `check_launch` left out of `process_state`: the launch trained one process."""
    out = tmp_path / "run"
    proc = _accelerate_launch(["--cpu", "--num_processes", "2"], ["--out_dir", str(out)])
    line = "error: accelerate launch started 1 process where several were asked"
    assert proc.returncode == 1 and sum(line in x for x in proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("subprocess.CalledProcessError")
    quiet = _accelerate_launch(["--cpu", "--num_processes", "2", "--quiet"], ["--out_dir", str(out)])
    assert quiet.returncode == 1 and quiet.stderr.strip().splitlines()[-1].startswith(line), quiet.stderr
    assert not out.exists()


TP_ON_THIS_CPU = ("error: --tensor_parallel 2 needs accelerate's FSDP2 plugin, which runs on GPUs, and this machine "
                  "has none: no launch here runs it; leave out --tensor_parallel (accelerate_configs/cpu_2proc.yaml "
                  "trains the rest of the run on this CPU), or launch on GPUs with accelerate_configs/fsdp_8gpu.yaml")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_refusal_after_the_processes_start_is_the_first_line_and_the_reports_root_cause(tmp_path):
    """2 gloo processes (cpu_2proc.yaml) refused after their group is open (`--tensor_parallel 2` on this CPU: the
    layout is read once the processes run). torch's elastic agent fails the launch (exit 1) and accelerate prints its
    traceback; the project's line comes first, and the agent's report ends on it: its root cause's `traceback :`
    line, read from the error file train.py wrote (common.errors.tell_the_elastic_agent).

    An error of rank 1 alone is the report's root cause, rank 1's
    (`test_elastic.py::test_an_error_of_one_rank_is_one_line_and_stops_after_the_first_restart[0]`). The project's line
    is the only line of the launch's output that starts with `error:`, so `grep -m1 '^error:'` finds it
    (docs/faults.md).

    Seen to catch: `tell_the_elastic_agent` writing nothing: the report's root cause read "To enable traceback see",
    both tests fail. Rank 1 printing the shared line too (`run_cli` with `quiet=False` and no wait for rank 0): two
    `error:` lines. A timestamp a second early, against a tie with the ranks the agent stops, was tried and dropped: the
    rank-1 case passed 3 of 3 without it."""
    out = tmp_path / "run"
    proc = _accelerate_launch(["--config_file", str(CONFIGS / "cpu_2proc.yaml")],
                              ["--out_dir", str(out), "--tensor_parallel", "2"])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert lines[0] == TP_ON_THIS_CPU
    # docs/faults.md's "what to read": the one line that starts with `error:` (grep -m1 '^error:') is the project's
    assert [line for line in lines if line.startswith("error:")] == [TP_ON_THIS_CPU]
    assert lines[-1].startswith("=====") and lines[-2] == f"  traceback : {TP_ON_THIS_CPU}", proc.stderr
    assert lines[-4].startswith("  exitcode  : 2") and lines[-5] == "  rank      : 0 (local_rank: 0)"
    assert not out.exists()


# ---- --tensor_parallel on a machine without a GPU: every hop of the former circle ----------------------------

@pytest.mark.parametrize("name", ["one process", "cpu_2proc", "8gpu", "fsdp_8gpu"])
def test_tensor_parallel_on_a_cpu_says_no_launch_here_runs_it(monkeypatch, name):
    """Before, one process, cpu_2proc.yaml and 8gpu.yaml said "launch with accelerate_configs/fsdp_8gpu.yaml",
    fsdp_8gpu.yaml on a CPU said "launch with accelerate_configs/cpu_2proc.yaml ..., which trains the same run", and
    cpu_2proc.yaml refused tensor parallelism. Now each hop says that no launch on this machine runs it.

    Seen to catch: `tensor_parallel_here` (now `degree_here`) answering None (the three DDP hops fail); `_FIX`
    without its tensor-parallel clause (the fsdp_8gpu hop fails)."""
    from common.errors import UserError
    from common.parallelism import Parallelism
    from training.distributed.layout import Layout
    from training.distributed.machine import Machine, check_launch

    env = {} if name == "one process" else launched_environment(_config_args(name))
    outcome(monkeypatch, env, Machine(gpus=0, cores=2))  # sets the launch's environment
    world = int(env.get("WORLD_SIZE", "1"))
    with pytest.raises(UserError) as err:
        if name == "fsdp_8gpu":  # refused as a launch before the layout is read
            check_launch(machine=Machine(gpus=0, cores=2))
        Layout(world, Parallelism("ddp", tensor_parallel=2)).check(Machine(gpus=0, cores=2))
    line = str(err.value)
    if name == "fsdp_8gpu":
        assert "cpu_2proc.yaml (DDP on gloo), which trains the same run unsharded (without --tensor_parallel, which " \
               "needs FSDP on GPUs: no launch on a CPU runs it)" in line
    else:
        assert line == TP_ON_THIS_CPU.removeprefix("error: ")
    with pytest.raises(UserError, match="launch with accelerate_configs/fsdp_8gpu.yaml, or leave out"):
        Layout(world, Parallelism("ddp", tensor_parallel=2)).check(Machine(gpus=8, cores=16))  # a GPU machine: FSDP2


# ---- DeepSpeed imported only where it runs ---------------------------------------------------------------------

_REPORT_IMPORTED = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_{kind}({target!r}, run_name="__main__")
finally:
    print("deepspeed imported:", "deepspeed" in sys.modules)
"""


@pytest.mark.slow
def test_a_run_and_a_cli_that_do_not_use_deepspeed_never_import_it(tmp_path):
    """With DeepSpeed installed (`.[dev]`), train.py on one process (a checkpoint, an evaluation, the export) and
    `python -m eval.val_loss` on its run: DeepSpeed is never imported, so its `[WARNING] ... Setting accelerator to
    CPU` is no longer their first line (accelerate's unwrapping imported it: model/unwrap.py).

    ZeRO runs still unwrap through accelerate (`test_engines.py::test_engine_run_equals_one_process[zero2_8gpu]`,
    `[zero3_8gpu]`).

    Seen to catch: the run header's unwrap put back to `accelerator.unwrap_model`: `deepspeed imported: True`."""
    out = tmp_path / "run"
    for kind, target, args in (("path", "train.py", [*TINY, "--max_steps", "2", "--save_every", "1", "--eval_every",
                                                      "1", "--out_dir", str(out)]),
                               ("module", "eval.val_loss", ["--model", str(out)])):
        proc = subprocess.run([sys.executable, "-c", _REPORT_IMPORTED.format(kind=kind, target=target), target, *args],
                              cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip().splitlines()[-1] == "deepspeed imported: False", (target, proc.stderr[-3000:])
        assert "Setting accelerator to CPU" not in proc.stderr


@pytest.mark.slow
def test_a_multi_node_config_alone_waits_in_torchs_rendezvous_before_train_py_starts(tmp_path):
    """docs/faults.md's answer for `multinode_2x8.yaml` launched on one machine (issue 55): machine rank 0's launcher
    waits for machine 1 inside torch's static rendezvous (900 s at 127.0.0.1:<port>) before it starts any process,
    so no code of the project runs and none can say a word; `LOGLEVEL=INFO` makes torch say what it waits for;
    Ctrl-C (SIGINT to the group) does not end the wait, SIGTERM does. Each claim the row makes is read here from
    the installed torch and accelerate: a release that changes one fails this test, and the row is rewritten.

    Seen to catch: the config's `num_machines: 1`: `min_nodes: 2` not in the log, fails. `rdzv_backend: c10d` in the
    config is not caught: accelerate still launches it static."""
    import signal
    import time

    from conftest import free_port

    port, out, log = free_port(), tmp_path / "run", tmp_path / "launcher.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "multinode_2x8.yaml"),
             "--main_process_port", str(port), "train.py", *TINY, "--max_steps", "1", "--out_dir", str(out)],
            cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO"}, stdout=sink,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Rendezvous'ing worker group" not in log.read_text() and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        text = log.read_text()
        assert "Rendezvous'ing worker group" in text, text[-3000:]
        for line in ("min_nodes                : 2", "rdzv_backend             : static",
                     f"rdzv_endpoint            : 127.0.0.1:{port}", "rdzv_configs             : {'rank': 0, "
                     "'timeout': 900}"):
            assert line in text, text[-3000:]
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends
        time.sleep(5)
        assert proc.poll() is None, "Ctrl-C ended the wait: docs/faults.md says it does not"
        assert not out.exists()  # train.py never started: no process of the launch ran it
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---- a group's variables left over in a shell (issue 60) ------------------------------------------------------

LEFTOVERS = [
    {"WORLD_SIZE": "2"},
    {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"},
    {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"},
    {"LOCAL_RANK": "0"},
]


def _only(monkeypatch, env: dict[str, str]) -> None:
    """`env` as the only group and launcher variables of this process's environment."""
    from common.launch import GROUP_VARIABLES, LAUNCHER_MARKS

    for name in (*GROUP_VARIABLES, *LAUNCHER_MARKS):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("env", LEFTOVERS, ids=lambda env: ",".join(env))
def test_a_leftover_group_environment_is_one_line_before_any_wait(monkeypatch, capsys, tmp_path, env):
    """A plain `python train.py` in a shell that another launch left WORLD_SIZE (and MASTER_ADDR, RANK...) in: one line
    naming the variables and what to do, before accelerate opens a group; no run folder. Seen to catch (as a process,
    before the check existed): accelerate's 19-line ValueError traceback for WORLD_SIZE=2 alone and for LOCAL_RANK=0;
    a silent wait in the rendezvous with MASTER_ADDR/MASTER_PORT (killed at 60 s, no folder)."""
    from conftest import run_in_process

    _only(monkeypatch, env)
    err = run_in_process(monkeypatch, capsys, ["--out_dir", str(tmp_path / "run"), "--max_steps", "1"])
    assert all(f"{name}={value}" in err for name, value in env.items()), err
    assert f"`unset {' '.join(env)}` and run `python train.py` again" in err or "unset" in err, err
    assert "no launcher started this process" in err and not (tmp_path / "run").exists()


def test_a_launchers_group_is_no_leftover(monkeypatch):
    """What torchrun or accelerate launch, DeepSpeed's launcher, srun or MPI set beside the variables marks a real
    group; a plain process with none of them is not one."""
    from common.launch import leftover_group_variables

    group = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    for mark in ("TORCHELASTIC_RUN_ID", "CROSS_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        _only(monkeypatch, {**group, mark: "0"})
        assert leftover_group_variables("python train.py") is None, mark
    for alone in ({}, {"WORLD_SIZE": "1"}, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}, {"RANK": "0"}):
        _only(monkeypatch, alone)
        assert leftover_group_variables("python train.py") is None, alone


def test_an_evaluation_in_a_leftover_group_environment_is_one_line(monkeypatch):
    from common.errors import UserError
    from eval.common import cli_accelerator

    _only(monkeypatch, {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"})
    with pytest.raises(UserError, match=r"^a launch's variables are left in the environment \(WORLD_SIZE=2, "
                                        r"MASTER_ADDR=127.0.0.1, MASTER_PORT=29511\).*run `python -m eval.hellaswag` "
                                        r"again"):
        with cli_accelerator(cpu=False, command="python -m eval.hellaswag"):
            pass


@pytest.mark.slow
def test_a_leftover_group_environment_ends_a_real_process_at_once(tmp_path):
    """The same as a user meets it, a process of its own: with MASTER_ADDR/MASTER_PORT set too it waited silently
    (90 s seen, no folder). Now it exits 2 with the one line, well before the rendezvous' timeout."""
    env = {key: value for key, value in os.environ.items() if key not in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID")}
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "train.py", *TINY, "--max_steps", "1", "--out_dir", str(tmp_path / "run")],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: a launch's variables are left in "
                                                           "the environment (WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, "
                                                           "MASTER_PORT=29511)"), proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()
