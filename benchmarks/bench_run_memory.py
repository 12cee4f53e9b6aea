"""Peak memory of whole `train.py` runs, phase by phase, against the memory planner's plan of the run.

    python -m benchmarks.bench_run_memory                   # every shape below, one fresh run each
    python -m benchmarks.bench_run_memory --shape small-ddp --shape gpt2-ac
    python -m benchmarks.bench_run_memory --list            # the shapes and their train.py flags

Each shape is one run of train.py itself (its setup, steps, validation, HellaSwag when on, checkpoint saves and
final export) through `benchmarks.run_phases`, which records each phase's peak RSS; the whole process's is the
kernel's high-water mark, what `/usr/bin/time -f %M` reports. Beside them, the planner's plan of the same run
(`planner.plan_run`, fp32 on the CPU with train.py's process RSS). Every run trains 2 steps, so the
second step holds the optimizer state the plan counts (the first step's forward has none yet), and evaluates and
saves once, at the end. 2-process shapes run on gloo (accelerate_configs/cpu_2proc.yaml); each rank's figures are
its own, the plan is per process. Exit status 1 when a run's planned peak is more than 15% from its measured one.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common.cli import CliParser
from common.errors import UserError, run_cli
from planner import GiB, Launch, RunPhases, RunPlan, model_config, plan_run
from training.distributed.layout import Layout

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = 0.15
# HellaSwag's validation split, a local copy beside the checkout (as benchmarks/gpu_acceptance.py finds it)
HELLASWAG_DATA = REPO.parent / "shared" / "assets" / "hellaswag_val_approx.jsonl.gz"


@dataclass(frozen=True)
class Shape:
    model: str
    micro_batch_size: int
    block_size: int
    processes: int = 1
    activation_checkpointing: bool = False
    hellaswag_items: int = 0  # 0: HellaSwag off

    def train_args(self, out_dir: Path, hellaswag_data: Path | str = HELLASWAG_DATA) -> list[str]:
        """train.py's flags for this shape: 2 steps, the evaluations, one checkpoint save and the export at the end."""
        config = model_config(self.model, self.block_size)
        tokens = self.micro_batch_size * self.block_size * self.processes
        args = ["--out_dir", str(out_dir), "--n_layer", str(config.n_layer), "--n_head", str(config.n_head),
                "--n_embd", str(config.n_embd), "--block_size", str(self.block_size),
                "--micro_batch_size", str(self.micro_batch_size), "--total_batch_size", str(tokens),
                "--max_steps", "2", "--warmup_steps", "1", "--optimizer", "adamw", "--eval_every", "1000",
                "--save_every", "1000", "--sample_tokens", "0"]
        if self.activation_checkpointing:
            args.append("--activation_checkpointing")
        if self.hellaswag_items:
            args += ["--hellaswag_every", "1000", "--hellaswag_data", str(hellaswag_data),
                     "--hellaswag_limit", str(self.hellaswag_items)]
        return args

    def plan(self, device: str = "cpu") -> RunPlan:
        """The planner's plan of this run: fp32 on the CPU, bf16 autocast on CUDA (as train.py runs each)."""
        launch = Launch(self.micro_batch_size, Layout(self.processes), dtype="bf16" if device == "cuda" else "fp32",
                        device=device, activation_checkpointing=self.activation_checkpointing)
        run = RunPhases(eval_batch_size=self.micro_batch_size,
                        evaluations=("validation", "hellaswag") if self.hellaswag_items else ("validation",))
        return plan_run(model_config(self.model, self.block_size), launch, run)


SHAPES = {  # on this machine's CPU, fp32
    "gpt2-ac": Shape("gpt2", 8, 1024, activation_checkpointing=True),
    "small": Shape("small", 32, 256),
    "small-hellaswag": Shape("small", 8, 256, hellaswag_items=200),
    "small-ddp": Shape("small", 16, 256, processes=2),
}
GPU_SHAPES = {  # --device cuda (benchmarks/gpu_acceptance.py's memory_plan stage): bf16 autocast, eager
    "gpt2_16x1024": Shape("gpt2", 16, 1024, hellaswag_items=200),
    "gpt2-medium_8x1024": Shape("gpt2-medium", 8, 1024, hellaswag_items=200),
    "gpt2_16x1024_ac": Shape("gpt2", 16, 1024, activation_checkpointing=True, hellaswag_items=200),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(shape: Shape, folder: Path, device: str, hellaswag_data: str) -> dict:
    """Run the shape once; every rank's phases, and the launch's max RSS from wait4 (as /usr/bin/time)."""
    reports = folder / "phases"
    probe = ["-m", "benchmarks.run_phases", str(reports), *shape.train_args(folder / "run", hellaswag_data)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(shape.processes),
              "--main_process_port", str(_free_port())]
    if device == "cuda":
        cmd = launch + ["--config_file", str(REPO / "accelerate_configs" / "single_gpu.yaml"), "--dynamo_backend",
                        "no", *probe]
    elif shape.processes == 1:
        cmd = [sys.executable, *probe]
    else:
        cmd = launch + ["--config_file", str(REPO / "accelerate_configs" / "cpu_2proc.yaml"), *probe]
    log = folder / "train.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        # the folder may be a temporary one, gone when this exits: the log's end goes to stderr first
        print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
        raise UserError(f"the run failed (exit {os.waitstatus_to_exitcode(status)}); its log's end is above ({log})")
    ranks = [json.loads((reports / f"rank{r}.json").read_text()) for r in range(shape.processes)]
    return {"ranks": ranks, "max_rss": usage.ru_maxrss * 1024}


def report(name: str, shape: Shape, measured: dict, device: str) -> float:
    plan = shape.plan(device)
    planned = plan.phases
    whole = max(r["whole"] for r in measured["ranks"])
    error = plan.peak / whole - 1
    print("RUN_PLAN " + json.dumps({"shape": name, "device": device, "planned": planned, "planned_peak": plan.peak,
                                    "planned_phase": plan.phase, "measured": measured["ranks"][0]["phases"],
                                    "measured_peak": whole, "max_rss": measured["max_rss"], "error": error}))
    phases = [p for p in measured["ranks"][0]["phases"] if p != "other"]
    print(f"{name}: {shape.model} {shape.micro_batch_size} x {shape.block_size}, {shape.processes} process(es)"
          + (", activation checkpointing" if shape.activation_checkpointing else "")
          + (f", HellaSwag {shape.hellaswag_items} items" if shape.hellaswag_items else ""))
    for phase in phases + ["other"]:
        got = " / ".join(f"{r['phases'].get(phase, 0) / GiB:.3f}" for r in measured["ranks"])
        plan_of = f"{planned[phase] / GiB:.3f}" if phase in planned else "-"
        print(f"  {phase:<16} measured {got:>13} GiB   planned {plan_of:>6} GiB")
    what = "whole process" if device == "cpu" else "whole run"
    print(f"  {what:<16} measured {whole / GiB:.3f} GiB (launch's max RSS {measured['max_rss'] / GiB:.3f})   "
          f"planned peak {plan.peak / GiB:.3f} GiB ({plan.phase})   error {error:+.1%}", flush=True)
    return error


def main() -> int:
    parser = CliParser(prog="python -m benchmarks.bench_run_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help=f"run only these (repeatable): {', '.join(SHAPES)}; "
                        f"with --device cuda {', '.join(GPU_SHAPES)}")
    parser.add_argument("--list", action="store_true", help="print the shapes' train.py flags and stop")
    parser.add_argument("--keep", default=None, help="keep the runs' folders under this directory")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: the GPU shapes, "
                        "torch.cuda.max_memory_allocated per phase (accelerate_configs/single_gpu.yaml, eager)")
    parser.add_argument("--hellaswag_data", default=str(HELLASWAG_DATA), help="HellaSwag jsonl(.gz) of the "
                        "shapes with HellaSwag on")
    args = parser.parse_args()
    shapes = SHAPES if args.device == "cpu" else GPU_SHAPES
    names = args.shape or list(shapes)
    unknown = [name for name in names if name not in shapes]
    if unknown:
        raise UserError(f"no {args.device} shape {unknown[0]!r}; choose from {', '.join(shapes)}")
    if args.list:
        for name in names:
            print(f"{name}: {' '.join(shapes[name].train_args(Path('OUT'), args.hellaswag_data))}")
        return 0
    worst = 0.0
    with tempfile.TemporaryDirectory(dir=args.keep) as tmp:
        for name in names:
            folder = Path(tmp) / name
            folder.mkdir()
            measured = measure(shapes[name], folder, args.device, args.hellaswag_data)
            worst = max(worst, abs(report(name, shapes[name], measured, args.device)))
    print(f"largest error {worst:.1%} (target: within {TOLERANCE:.0%})")
    return 0 if worst <= TOLERANCE else 1


def cli() -> None:
    raise SystemExit(main())


if __name__ == "__main__":
    run_cli(cli)
