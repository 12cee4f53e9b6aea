"""How far a Muon run on several processes lands from the same run on one process, step after step (a measurement,
not a timing): what docs/engines.md ("Muon on several processes") states, and what a user can check.

    python train.py --save_every 10 --keep_last 20 --out_dir out/one
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train.py --save_every 10 --keep_last 20 \\
        --out_dir out/ddp
    python -m benchmarks.muon_distance out/one out/ddp

Both runs see the same global batch from the same initial weights (the default `--seed`); under DDP each step's
gradient is the same sum taken in another order, which moves its last bits, and Muon's Newton-Schulz in bf16 (GPUs,
CPUs with bf16 units) turns those into updates a few percent apart, which later steps carry on. For every checkpoint
both runs hold, one line: the largest element's distance, each block matrix's distance relative to its own move
from the initial weights (the worst and the median; what tests/test_muon.py bounds after 4 steps), the whole model's
relative distance, and the two runs' training and validation losses at that step.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
from accelerate.utils import set_seed

from checkpoint_io.reader import read_config, read_state
from common.run_dir import RunDir, checkpoint_step
from model import GPT, GPTConfig
from model.config import TIED_OUTPUT


def initial_weights(config: GPTConfig, seed: int) -> dict[str, torch.Tensor]:
    """train.py's initial weights of a run from scratch with `--seed seed`."""
    set_seed(seed)
    return {k: v for k, v in GPT(config).state_dict().items() if k != TIED_OUTPUT}


def metrics(run: RunDir) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, run.metrics_file.read_text().splitlines())}


def distances(one: dict[str, torch.Tensor], other: dict[str, torch.Tensor],
              start: dict[str, torch.Tensor]) -> dict[str, float]:
    """The largest element's distance, the block matrices' relative distances (worst, median) and the whole model's."""
    matrices = [k for k in one if ".h." in k and one[k].dim() == 2]
    relative = [((other[k] - one[k]).norm() / (one[k] - start[k]).norm()).item() for k in matrices]
    apart = sum(((other[k] - one[k]) ** 2).sum() for k in one) ** 0.5
    moved = sum(((one[k] - start[k]) ** 2).sum() for k in one) ** 0.5
    return {"max_abs": max((other[k] - one[k]).abs().max().item() for k in one), "worst_matrix": max(relative),
            "median_matrix": statistics.median(relative), "model": (apart / moved).item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("one", help="the run on one process (its --out_dir)")
    parser.add_argument("other", help="the same run on several processes")
    parser.add_argument("--seed", type=int, default=1337, help="the runs' --seed (train.py's default)")
    args = parser.parse_args()
    one, other = RunDir(args.one), RunDir(args.other)
    steps = sorted({checkpoint_step(p) for p in one.list_checkpoints()} &
                   {checkpoint_step(p) for p in other.list_checkpoints()})
    config = GPTConfig(**read_config(one.checkpoint(steps[0])))
    start = initial_weights(config, args.seed)
    logged = metrics(one), metrics(other)
    print("step | max abs | block matrix rel. (worst, median) | model rel. | loss (one, other) | val_loss")
    for step in steps:
        a, b = (read_state(run.checkpoint(step)).weights for run in (one, other))
        d = distances(a, b, start)
        losses = [m.get(step, {}) for m in logged]
        val = " ".join(f"{m['val_loss']:.4f}" for m in losses if "val_loss" in m) or "-"
        print(f"{step} | {d['max_abs']:.3g} | {d['worst_matrix']:.3g}, {d['median_matrix']:.3g} | {d['model']:.3g} | "
              + " ".join(f"{m['loss']:.4f}" for m in losses if "loss" in m) + f" | {val}")


if __name__ == "__main__":
    main()
