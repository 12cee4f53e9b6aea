"""Evaluations during training: each registered evaluation on its schedule, and the health check before a save.

They run on every rank, since FSDP's forwards need all of them. They run on the plain module: a no-grad pass needs
no DDP, and torch.compile would recompile for every eval shape. FSDP2 shards the module in place, so its gathers
still run.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from accelerate import Accelerator

from configs import EvalConfig
from data.pairs import PairExamples
from data.source import DataSource
from eval.val_loss import evaluate_loss
from model.unwrap import unwrapped
from training.evaluations.registry import EVALUATIONS
from training.evaluations.spec import Context, EvaluationSpec


class TrainingEvals:
    """The evaluations the run's flags turn on, their data loaded once, and when to score them.

    Built before the first step, so bad evaluation data is refused before any training time is spent."""

    def __init__(self, cfg: EvalConfig, parsed: Mapping[str, Any], source: DataSource, block_size: int, seed: int,
                 accelerator: Accelerator) -> None:
        """`parsed`: the run's own flag groups (`TrainConfig.added`), among them each evaluation's."""
        self.accelerator, self.block_size = accelerator, block_size
        self.parsed = parsed
        contexts = {name: Context(spec.flags_in(parsed), cfg.eval_batch_size, source, block_size, seed, accelerator)
                    for name, spec in EVALUATIONS.items()}
        # name -> (spec, its context, its data), in the registry's order; validation always runs (--eval_every > 0)
        self.active = {name: (spec, contexts[name], spec.load(contexts[name]))
                       for name, spec in EVALUATIONS.items() if spec.every(contexts[name].flags)}
        self.val_tokens = self.active["validation"][2]  # the health check's first window
        self.pairs = isinstance(self.val_tokens, PairExamples)  # held-out examples (at least one), not a stream
        self.scored: tuple[int, dict[str, float]] | None = None  # the last evaluations' step and scores

    def _due(self, step: int, last: bool) -> list[tuple[EvaluationSpec, Context, Any]]:
        return [(spec, ctx, data) for spec, ctx, data in self.active.values()
                if last or step % spec.every(ctx.flags) == 0]

    def due(self, step: int, last: bool) -> bool:
        """Whether an evaluation runs after `step` (every one at the last step)."""
        return bool(self._due(step, last))

    def run_due(self, model: torch.nn.Module, step: int, last: bool, write: Callable[[str], None]) -> dict[str, Any]:
        """The evaluations due after `step` (all of them at the last step), printed and returned as metrics."""
        due = self._due(step, last)
        if not due:
            return {}
        accelerator = self.accelerator
        plain = unwrapped(model)
        bf16 = accelerator.mixed_precision == "bf16"
        plain.eval()
        results, texts = {}, []
        for spec, ctx, data in due:
            scores, text = spec.score(plain, data, ctx, bf16)
            results.update(scores)
            if text is not None:
                texts.append(text)
        _reshard(plain)
        plain.train()
        if accelerator.is_main_process:
            write(f"step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in results.items())
                  + "".join(f"\n---\n{text}\n---" for text in texts))
        self.scored = (step, results)
        return results

    def next_steps(self, run: Path) -> str:
        """The run's last line but one (`next_steps`), from this attempt's last evaluations."""
        return next_steps(run, self.scored, self.parsed)

    def finite_loss(self, model: torch.nn.Module) -> bool:
        """Whether the weights give a finite loss on the first validation window or example: a cheap check before a
        save, with the same answer on every rank."""
        accelerator = self.accelerator
        plain = unwrapped(model)
        block = self.block_size
        first = self.val_tokens[:1] if self.pairs else self.val_tokens[:block + 1]
        loss = evaluate_loss(plain, first, block_size=block, batch_size=1,
                             accelerator=accelerator, bf16=accelerator.mixed_precision == "bf16")
        _reshard(plain)
        return math.isfinite(loss)


def next_steps(run: Path, scored: tuple[int, dict[str, float]] | None, parsed: Mapping[str, Any]) -> str:
    """The run's last line but one: the scores of its last evaluations (`scored`: step, scores by metrics key) and
    the commands to run next. Between sampling and the Hub push, each registered evaluation that scores a model on
    its own says how (`EvaluationSpec.next_command`, from its flags in `parsed`). Each runs as written, offline too."""
    labels = {m.key: m.label for spec in EVALUATIONS.values() for m in spec.metrics}
    result = ""
    if scored:
        step, scores = scored
        shown = ", ".join(f"{labels.get(key, key)} {value:.4f}" for key, value in scores.items())
        result = f"{shown} at step {step}; "
    commands = [f"python -m model.sample --model {run} --prompt \"...\"",
                *(spec.next_command(str(run), spec.flags_in(parsed)) for spec in EVALUATIONS.values()
                  if spec.next_command is not None),
                f"python -m publish.hub --run_dir {run} --hub_model_id <user>/<name>"]
    return result + "next: " + ", ".join(commands)


def _reshard(module: torch.nn.Module) -> None:
    """Free FSDP2's gathered root parameters (embeddings, ln_f) after forwards without a backward. FSDP2 would keep
    them until the next backward; the next forward gathers them again. A no-op where FSDP does not shard."""
    if hasattr(module, "reshard"):
        module.reshard()
