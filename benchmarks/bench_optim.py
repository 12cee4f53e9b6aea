"""Token efficiency: the same model on the same tokens, trained with AdamW and with Muon.

    python -m benchmarks.bench_optim                        # both setups below, AdamW vs Muon
    python -m benchmarks.bench_optim --setup shakespeare --runs adamw,muon,muon-qkv-split --steps 150

Setups: `shakespeare` is the default `python train.py` run (TrainConfig's defaults: 4 layers, 128 wide,
2,048 tokens a step); `fineweb` a model of the same shape on the FineWeb sample parquet in
../shared/assets. Each run starts from the same initial weights and reads the same batches (the
project's own loader, `build_optimizer`, `learning_rate` and `train_step`); the validation loss is
scored on the run's fixed validation tokens every `--eval_every` steps. Runs:
- `adamw`: `--optimizer adamw` at `--adamw_lr` (1e-3: the best of 1e-3, 3e-3 and 1e-2 on the default
  shape, docs/benchmarks.md; the `--lr` that suits Muon's AdamW part, 1e-2, is too high for AdamW alone).
- `muon`: `--optimizer muon` (torch.optim.Muon on the blocks' matrices at `--muon_lr`, AdamW at `--lr` on
  the embeddings/output layer, biases and LayerNorms).
- `muon-qkv-split`: Muon with attention's stacked (3C x C) q,k,v matrix held as three (C x C) matrices,
  so that each is orthogonalised apart (a benchmark-only module: the same function, other parameters).

Prints validation loss against tokens, the step at which each run first reaches AdamW's final validation
loss (linear interpolation between evaluations), and writes `<out>.json` and `<out>.png`.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

from common.cli import CliParser
from common.errors import run_cli
from configs import DataConfig, TrainConfig
from data.source import open_source
from eval.val_loss import evaluate_loss
from model import GPT, GPTConfig
from training.distributed.processes import BatchGeometry
from training.optimizers.plan import build_optimizer, plan_optimizers
from training.step import LRSchedule, train_step

FINEWEB = Path(__file__).resolve().parents[2] / "shared" / "assets" / "fineweb_sample_100docs.parquet"
SETUPS = {"shakespeare": {}, "fineweb": {"dataset": str(FINEWEB)}}
RUNS = ("adamw", "muon", "muon-qkv-split")


class SplitQKV(nn.Module):
    """c_attn as three (C x C) projections whose outputs are concatenated: the same function as one
    (3C x C) Linear, but three matrices for Muon to orthogonalise apart."""

    def __init__(self, stacked: nn.Linear) -> None:
        super().__init__()
        C = stacked.in_features
        self.q, self.k, self.v = (nn.Linear(C, C, bias=stacked.bias is not None) for _ in range(3))
        with torch.no_grad():
            for i, part in enumerate((self.q, self.k, self.v)):
                part.weight.copy_(stacked.weight[i * C:(i + 1) * C])
                if stacked.bias is not None:
                    part.bias.copy_(stacked.bias[i * C:(i + 1) * C])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def train_one(run: str, cfg: TrainConfig, accelerator: Accelerator, val_tokens, eval_every: int,
              adamw_lr: float) -> dict:
    """Train `--max_steps` steps from `--seed`; the validation curve and the CPU/wall seconds."""
    adamw_only = run == "adamw"
    optim = replace(cfg.optim, optimizer="adamw", lr=adamw_lr) if adamw_only else replace(cfg.optim, optimizer="muon")
    plan, arch, steps = plan_optimizers(optim, cfg.model, cfg.added), cfg.model, cfg.training.max_steps
    set_seed(cfg.training.seed)
    model = GPT(GPTConfig(n_layer=arch.n_layer, n_head=arch.n_head, n_embd=arch.n_embd, block_size=arch.block_size))
    if run == "muon-qkv-split":
        for block in model.transformer.h:
            block.attn.c_attn = SplitQKV(block.attn.c_attn)
    loader = open_source(cfg.data).train_loader(block_size=arch.block_size, rank=0, world_size=1,
                                                micro_batch_size=cfg.training.micro_batch_size, seed=cfg.training.seed)
    geometry = BatchGeometry.for_total(cfg.training.total_batch_size, cfg.training.micro_batch_size, arch.block_size, 1)
    schedule = LRSchedule(optim.warmup_steps, steps, optim.min_lr_ratio)
    model, *optimizers = accelerator.prepare(model, *build_optimizer(model, plan, "cpu"))

    def val_loss() -> float:
        model.eval()
        loss = evaluate_loss(model, val_tokens, block_size=arch.block_size, batch_size=cfg.eval.eval_batch_size)
        model.train()
        return loss

    curve = [{"step": 0, "tokens": 0, "val_loss": val_loss()}]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    model.train()
    for step in range(steps):
        lrs = plan.lrs_at(schedule.factor(step))
        train_step(accelerator, model, optimizers, loader.next_batch, geometry.accumulation, lrs,
                   cfg.training.grad_clip)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            curve.append({"step": step + 1, "tokens": (step + 1) * geometry.tokens_per_step, "val_loss": val_loss()})
            print(f"  {run:<15} step {step + 1:4d}  val_loss {curve[-1]['val_loss']:.4f}", flush=True)
    accelerator.free_memory()
    return {"curve": curve, "cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - wall0}


def steps_to_reach(curve: list[dict], target: float) -> float | None:
    """The first (interpolated) step at which the validation loss is at or below `target`; None if never."""
    for before, after in zip(curve, curve[1:]):
        if after["val_loss"] <= target:
            span = before["val_loss"] - after["val_loss"]
            frac = 1.0 if span <= 0 else (before["val_loss"] - target) / span
            return before["step"] + frac * (after["step"] - before["step"])
    return None


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (setup, result) in zip(axes[0], results.items()):
        for run, r in result["runs"].items():
            ax.plot([p["tokens"] for p in r["curve"][1:]], [p["val_loss"] for p in r["curve"][1:]], label=run)
        ax.axhline(result["target"], color="grey", linestyle=":", label="AdamW's final")
        ax.set(title=setup, xlabel="training tokens", ylabel="validation loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = CliParser(prog="python -m benchmarks.bench_optim", description=__doc__.split("\n")[0])
    parser.add_argument("--setup", choices=[*SETUPS, "both"], default="both", help="which data and model")
    parser.add_argument("--runs", default="adamw,muon", help=f"comma-separated, from {', '.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps; default: the config's max_steps")
    parser.add_argument("--eval_every", type=int, default=10, help="validation loss every N steps")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak LR of Muon runs' AdamW part; default: the config's")
    parser.add_argument("--adamw_lr", type=float, default=1e-3, help="peak LR of the AdamW-only run")
    parser.add_argument("--muon_lr", type=float, default=None, help="Muon's peak LR; default: the config's")
    parser.add_argument("--out", default="benchmarks/results/bench_optim", help="writes OUT.json and OUT.png")
    args = parser.parse_args()
    runs = args.runs.split(",")
    if unknown := [r for r in runs if r not in RUNS]:
        parser.error(f"--runs: unknown {', '.join(unknown)}; choose from {', '.join(RUNS)}")

    accelerator = Accelerator(cpu=True)
    results = {}
    for setup in SETUPS if args.setup == "both" else [args.setup]:
        cfg = TrainConfig(data=DataConfig(**SETUPS[setup]))
        cfg.training = replace(cfg.training, **({"max_steps": args.steps} if args.steps else {}))
        cfg.optim = replace(cfg.optim, **({"lr": args.lr} if args.lr else {}))
        if args.muon_lr:
            cfg.added["muon"] = replace(cfg.added["muon"], muon_lr=args.muon_lr)
        val_tokens = open_source(cfg.data).val_set(cfg.model.block_size)
        print(f"{setup}: {cfg.model.n_layer} layers x {cfg.model.n_embd}, {cfg.training.total_batch_size} tokens/step, "
              f"{cfg.training.max_steps} steps, adamw run's lr {args.adamw_lr:g}, muon runs' lr {cfg.optim.lr:g} and "
              f"muon_lr {cfg.added['muon'].muon_lr:g}, {len(val_tokens)} validation tokens", flush=True)
        measured = {run: train_one(run, cfg, accelerator, val_tokens, args.eval_every, args.adamw_lr) for run in runs}
        target = measured[runs[0]]["curve"][-1]["val_loss"]
        for run, r in measured.items():
            r["steps_to_target"] = steps_to_reach(r["curve"], target)
            share = "never" if r["steps_to_target"] is None else \
                f"step {r['steps_to_target']:.0f} ({r['steps_to_target'] / cfg.training.max_steps:.0%} of the steps)"
            print(f"{setup} {run:<15} final val_loss {r['curve'][-1]['val_loss']:.4f} | reaches {runs[0]}'s final "
                  f"{target:.4f} at {share} | {r['cpu_s']:.0f} s CPU, {r['wall_s']:.0f} s wall")
        results[setup] = {"config": cfg.flat(), "target": target, "runs": measured}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    run_cli(main)
