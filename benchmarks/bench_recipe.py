"""The default run's recipe (`python train.py`): validation loss at the end against the compute it took.

    python -m benchmarks.bench_recipe                                # the recipes of RECIPES, one at a time
    python -m benchmarks.bench_recipe --runs default,new --parallel 2 --threads 1
    python -m benchmarks.bench_recipe --add 'deeper=--n_layer 6' --add 'wd0=--weight_decay 0'

Each run is `python train.py` with the recipe's flags on top of today's defaults (and `--sample_tokens 0`: the
scan wants losses; `--save_every` the run's length: one checkpoint), so every recipe is measured as a user
runs it. The validation loss is exact (seeded; deterministic for a machine's kind and thread count), so runs may
share a loaded machine: the comparison is the loss at equal compute, never the wall time, which is printed only
as a note. Compute is counted, not timed: training FLOPs = steps x tokens a step x `GPT.flops_per_token`
(6N + attention; on this model the 50,304-row output layer is 85% of it), plus each evaluation's forward pass
(a third of that per token, over --val_tokens); "x default" is the ratio to today's default recipe.

Prints one row per run (the validation loss at each evaluation, the last one first) and writes `<out>.json`.
With `--threads 1` (OMP_NUM_THREADS=1: the right setting for two runs in parallel on two cores) the losses
differ from a two-thread run in the last digits (another reduction order); rank with one, confirm with the other.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.cli import CliParser
from common.errors import UserError, run_cli
from common.run_dir import RunDir
from training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
QUIET = ["--sample_tokens", "0"]
# `--as_avx2`: train.py as a CPU without bf16 units runs it, on a CPU with them: Muon's Newton-Schulz in fp32
# (`training.optimizers.muon.newton_schulz_dtype` reads torch.cpu.get_capabilities), ATen's AVX2 kernels, oneDNN and
# MKL held to AVX2. An emulation: an AVX2 machine's own figure may differ in the last digits.
AVX2_SHIM = ("import runpy, sys, torch; caps = dict(torch.cpu.get_capabilities()); "
             "caps.update(avx512_bf16=False, amx_bf16=False); torch.cpu.get_capabilities = lambda: caps; "
             "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

# name -> train.py flags on top of the defaults. The sweep behind docs/benchmarks.md's table
# ("The default run's recipe, issue 55"); `default` is whatever `python train.py` runs today.
BEFORE = ("--total_batch_size 2048 --micro_batch_size 8 --max_steps 100 --warmup_steps 10 --eval_every 50 --lr 1e-2 "
          "--beta2 0.95 --muon_lr 0.02 --muon_momentum 0.95 --n_layer 4 --n_head 4 --n_embd 128")
RECIPES: dict[str, str] = {
    "default": "",
    # the recipe before issue 55, then issue 55's changes one at a time, each on top of the one before
    "before": BEFORE,
    "small_steps": BEFORE + " --total_batch_size 512 --micro_batch_size 2 --max_steps 400 --warmup_steps 40 --lr 3e-2"
                            " --eval_every 200",
    "narrow_deep": BEFORE + " --total_batch_size 512 --micro_batch_size 2 --max_steps 480 --warmup_steps 40 --lr 3e-2"
                            " --n_layer 6 --n_embd 48 --eval_every 160",
    "beta2_0.99": BEFORE + " --total_batch_size 512 --micro_batch_size 2 --max_steps 480 --warmup_steps 40 --lr 3e-2"
                           " --n_layer 6 --n_embd 48 --eval_every 160 --beta2 0.99",
    # ablations of today's default
    "momentum_0.95": "--muon_momentum 0.95",
    "steps_360": "--max_steps 360 --warmup_steps 30",
    "micro_4": "--micro_batch_size 4",
    "heads_2": "--n_head 2",
    "lr_5e-2": "--lr 5e-2",
    "muon_0.03": "--muon_lr 0.03",
    "seed_1": "--seed 1",
    "seed_2": "--seed 2",
}


def flops_per_token(model_flags: dict[str, int]) -> float:
    """`GPT.flops_per_token` of the model these flags build (on the meta device: nothing allocated)."""
    import torch

    from model.config import GPTConfig
    from model.gpt import GPT

    with torch.device("meta"):
        return GPT(GPTConfig(**model_flags)).flops_per_token()


def config_of(run_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())


def compute(config: dict, n_evals: int) -> dict[str, float]:
    """Training and evaluation FLOPs of a run with this config.yaml (`n_evals` validation passes)."""
    fpt = flops_per_token({k: config[k] for k in ("n_layer", "n_head", "n_embd", "block_size")})
    train = config["max_steps"] * config["total_batch_size"] * fpt
    evaluation = n_evals * config["val_tokens"] * fpt / 3
    return {"flops_per_token": fpt, "tokens": config["max_steps"] * config["total_batch_size"],
            "train_flops": train, "eval_flops": evaluation, "flops": train + evaluation}


def run(label: str, flags: list[str], out_dir: Path, threads: int | None, as_avx2: bool = False) -> dict:
    cmd = [sys.executable, *(["-c", AVX2_SHIM] if as_avx2 else []), str(REPO / "train.py"), *flags, *QUIET,
           "--out_dir", str(out_dir)]
    if "--save_every" not in flags:
        cmd += ["--save_every", "100000"]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}), **(AVX2_ENV if as_avx2 else {}))
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "train.log"  # what it printed: its last "time" line says where the wall time went
    start = time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own CPU time, whatever runs beside it
    wall = time.perf_counter() - start
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise UserError(f"{label}: {' '.join(cmd[1:])} failed (exit {code}): {log.read_text().strip()[-500:]}")
    curve = {r["step"]: r["val_loss"] for r in read_metrics(RunDir(out_dir).metrics_file) if "val_loss" in r}
    return {"flags": flags, "val_loss": curve, "final": curve[max(curve)], "wall_s": round(wall, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "load_average": os.getloadavg()[0],
            **compute(config_of(out_dir), len(curve))}


def main() -> None:
    parser = CliParser(prog="python -m benchmarks.bench_recipe", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default=",".join(RECIPES), help=f"comma-separated, from {', '.join(RECIPES)}")
    parser.add_argument("--add", action="append", default=[], metavar="LABEL=FLAGS",
                        help="a further recipe, e.g. 'deeper=--n_layer 6' (repeatable)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS of each run; default: torch's own (the cores)")
    parser.add_argument("--as_avx2", action="store_true",
                        help="run each recipe as a CPU without bf16 units does (fp32 Newton-Schulz, AVX2 kernels)")
    parser.add_argument("--work", type=Path, default=None, help="where the runs go; default: a temporary folder")
    parser.add_argument("--out", default="benchmarks/results/bench_recipe", help="writes OUT.json")
    args = parser.parse_args()
    names = [n for n in args.runs.split(",") if n]
    if unknown := [n for n in names if n not in RECIPES]:
        parser.error(f"--runs: unknown {', '.join(unknown)}; choose from {', '.join(RECIPES)}")
    recipes = {n: RECIPES[n] for n in names}
    for extra in args.add:
        label, sep, flags = extra.partition("=")
        if not sep or not label:
            parser.error(f"--add {extra!r}: write LABEL=FLAGS")
        recipes[label] = flags

    work = args.work or Path(tempfile.mkdtemp(prefix="bench_recipe-"))
    base_flops = None  # today's default recipe's compute, from its run (or, without one, from its config)
    if "default" not in recipes:
        from configs.schema import TrainConfig
        from training.evaluations import registry  # noqa: F401  --eval_every is validation's own flag

        defaults = TrainConfig().flat()
        base_flops = compute(defaults, defaults["max_steps"] // defaults["eval_every"])["flops"]
    results: dict = {"work": str(work), "threads": args.threads, "as_avx2": args.as_avx2, "runs": {}}

    def one(item: tuple[str, str]) -> tuple[str, dict]:
        label, flags = item
        return label, run(label, shlex.split(flags), work / label, args.threads, args.as_avx2)

    with ThreadPoolExecutor(args.parallel) as pool:
        for label, result in pool.map(one, recipes.items()):
            results["runs"][label] = result
            if label == "default":
                base_flops = result["flops"]
            ratio = f"{result['flops'] / base_flops:.2f}" if base_flops else "-"
            curve = "  ".join(f"{s}: {v:.4f}" for s, v in result["val_loss"].items())
            print(f"{label:<16} val {result['final']:.4f}  {result['flops'] / 1e12:5.2f} TFLOP (x default {ratio})  "
                  f"wall {result['wall_s']:.0f} s, CPU {result['cpu_s']:.0f} s (load {result['load_average']:.1f})  "
                  f"[{curve}]  {' '.join(result['flags'])}", flush=True)
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    run_cli(main)
