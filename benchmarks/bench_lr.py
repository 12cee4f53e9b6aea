"""Which peak learning rate fits which job: a scan through train.py itself, validation loss before and after.

    python -m benchmarks.bench_lr                                  # the four jobs below, default LR lists
    python -m benchmarks.bench_lr --jobs full,lora --base out/shakespeare --finetune_steps 100

Jobs, each on the default `python train.py` run's data (Tiny Shakespeare, 2,048 tokens a step, warmup 10,
cosine to 0.1 x the peak), every run a `python train.py` process with only the flags named here:
- `muon`: from scratch with `--optimizer muon` (the default), 100 steps, over (--lr, --muon_lr) pairs: --lr is
  the AdamW part's (embeddings/output layer, biases, LayerNorms), --muon_lr the blocks' matrices'.
- `adamw`: from scratch with `--optimizer adamw`, 100 steps.
- `full`: full fine-tuning (`--init_from BASE`, AdamW on every weight) for `--finetune_steps`.
- `lora`: `--init_from BASE --lora_rank 8` (AdamW on the adapters) for `--finetune_steps`.
BASE is a trained default run: `--base DIR`, else the script trains one first (`python train.py`). The
fine-tunes read the same data and validation tokens BASE was trained and scored on, so "before" is BASE's
own last validation loss.

Prints one row per run (validation loss at each evaluation) and writes `<out>.json`. Losses are exact
(deterministic on a given machine and thread count), so a loaded machine changes only the time taken.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common.cli import CliParser
from common.errors import UserError, run_cli
from common.run_dir import RunDir
from training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
JOBS = ("muon", "adamw", "full", "lora")
QUIET = ["--sample_tokens", "0", "--log_every", "10"]  # no samples: the scan wants losses only


def train(out_dir: Path, args: list[str]) -> list[dict]:
    """`python train.py` with `args` into `out_dir`; its metrics.jsonl records."""
    cmd = [sys.executable, str(REPO / "train.py"), *args, *QUIET, "--out_dir", str(out_dir)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"{' '.join(cmd[1:])} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return read_metrics(RunDir(out_dir).metrics_file)


def val_curve(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def runs_of(job: str, args) -> list[tuple[str, list[str]]]:
    """(label, train.py flags) of each run of `job`."""
    if job == "muon":
        pairs = [pair.split(":") for pair in args.muon_pairs.split(",")]
        return [(f"lr {lr} muon_lr {muon_lr}", ["--optimizer", "muon", "--lr", lr, "--muon_lr", muon_lr,
                                                "--eval_every", "50"]) for lr, muon_lr in pairs]
    if job == "adamw":
        return [(f"lr {lr}", ["--optimizer", "adamw", "--lr", lr, "--eval_every", "50"])
                for lr in args.adamw_lrs.split(",")]
    finetune = ["--init_from", str(args.base), "--max_steps", str(args.finetune_steps),
                "--eval_every", str(args.finetune_eval_every)]
    if job == "full":
        return [(f"lr {lr}", [*finetune, "--lr", lr]) for lr in args.full_lrs.split(",")]
    return [(f"lr {lr}", [*finetune, "--lora_rank", "8", "--lr", lr]) for lr in args.lora_lrs.split(",")]


def main() -> None:
    parser = CliParser(prog="python -m benchmarks.bench_lr", description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, from {', '.join(JOBS)}")
    parser.add_argument("--muon_pairs", default="3e-3:0.02,1e-2:0.02,3e-2:0.02,1e-2:0.01,1e-2:0.04",
                        help="comma-separated LR:MUON_LR pairs of the muon job")
    parser.add_argument("--adamw_lrs", default="3e-4,1e-3,3e-3", help="peak LRs of the adamw job")
    parser.add_argument("--full_lrs", default="3e-5,1e-4,3e-4", help="peak LRs of full fine-tuning")
    parser.add_argument("--lora_lrs", default="3e-4,1e-3,3e-3", help="peak LRs of LoRA (rank 8)")
    parser.add_argument("--finetune_steps", type=int, default=100, help="steps of each fine-tune")
    parser.add_argument("--finetune_eval_every", type=int, default=25, help="validation loss every N fine-tune steps")
    parser.add_argument("--base", type=Path, default=None,
                        help="a trained default run to fine-tune; default: train one (python train.py) first")
    parser.add_argument("--work", type=Path, default=None, help="where the runs go; default: a temporary folder")
    parser.add_argument("--out", default="benchmarks/results/bench_lr", help="writes OUT.json")
    args = parser.parse_args()
    jobs = args.jobs.split(",")
    if unknown := [j for j in jobs if j not in JOBS]:
        parser.error(f"--jobs: unknown {', '.join(unknown)}; choose from {', '.join(JOBS)}")

    work = args.work or Path(tempfile.mkdtemp(prefix="bench_lr-"))
    results: dict = {"work": str(work)}
    if {"full", "lora"} & set(jobs):
        if args.base is None:
            args.base = work / "base"
            print(f"training the base run (python train.py) into {args.base}", flush=True)
            train(args.base, [])
        before = val_curve(read_metrics(RunDir(args.base).metrics_file))
        results["base"] = {"path": str(args.base), "val_loss": before[max(before)]}
        print(f"base {args.base}: val_loss {results['base']['val_loss']:.4f} (before fine-tuning)", flush=True)
    for job in jobs:
        results[job] = {}
        for i, (label, flags) in enumerate(runs_of(job, args)):
            curve = val_curve(train(work / f"{job}_{i}", flags))
            results[job][label] = {"flags": flags, "val_loss": curve}
            print(f"{job:<6} {label:<22} " + "  ".join(f"step {s}: {v:.4f}" for s, v in curve.items()), flush=True)
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    run_cli(main)
