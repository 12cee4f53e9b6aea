"""Evaluations during training: validation loss with a text sample, and HellaSwag, each on its schedule.

They run on every rank (FSDP forwards need all of them) on the plain module: no-grad passes need
neither DDP nor torch.compile, whose graphs would recompile for every eval shape; FSDP2 shards the
module in place, so its gathers still run.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from accelerate import Accelerator

from configs import EvalConfig
from data import get_tokenizer
from data.pairs import PairExamples
from data.source import DataSource
from eval.val_loss import evaluate_loss
from model import GPT
from model.unwrap import unwrapped


def sample(model: GPT, prompt: str, max_new_tokens: int, seed: int, device: torch.device) -> str:
    """A short sample from a fixed seed, drawn without disturbing the training RNG streams."""
    enc = get_tokenizer()
    ids = torch.tensor([enc.encode(prompt, allowed_special="all")], device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        out = model.generate(ids, max_new_tokens=max_new_tokens, temperature=1.0, top_k=200)
    return enc.decode(out[0].tolist())


class TrainingEvals:
    """The run's fixed validation tokens and HellaSwag items, loaded once, and when to score them.

    Built before the first step: a validation set shorter than one window (block_size + 1 tokens) and bad
    HellaSwag data are refused here, before any training time is spent."""

    def __init__(self, cfg: EvalConfig, source: DataSource, block_size: int, seed: int,
                 accelerator: Accelerator) -> None:
        self.cfg, self.block_size, self.seed, self.accelerator = cfg, block_size, seed, accelerator
        self.val_tokens = source.val_set(block_size)  # refuses a set shorter than a window, with the fix
        self.pairs = isinstance(self.val_tokens, PairExamples)  # held-out examples (at least one), not a stream
        self.hellaswag_items = None
        if cfg.hellaswag_every:
            from eval.hellaswag import load_items, require_metric_packages

            require_metric_packages()

            self.hellaswag_items = load_items(cfg.hellaswag_data, cfg.hellaswag_limit, flag="--hellaswag_data",
                                              limit_flag="--hellaswag_limit")

    def run_due(self, model: torch.nn.Module, step: int, last: bool, write: Callable[[str], None]) -> dict[str, Any]:
        """The evaluations due after `step` (all of them at the last step), printed and returned as metrics."""
        cfg = self.cfg
        val = step % cfg.eval_every == 0 or last
        hellaswag = self.hellaswag_items is not None and (step % cfg.hellaswag_every == 0 or last)
        if not (val or hellaswag):
            return {}
        plain = unwrapped(model)
        bf16 = self.accelerator.mixed_precision == "bf16"
        plain.eval()
        results, text = {}, None
        if val:
            results["val_loss"] = evaluate_loss(plain, self.val_tokens, block_size=self.block_size,
                                                batch_size=cfg.eval_batch_size, accelerator=self.accelerator, bf16=bf16)
            # Sampling from non-finite logits would fail inside torch.multinomial. --sample_tokens 0: no sample.
            if not cfg.sample_tokens:
                text = None
            elif math.isfinite(results["val_loss"]):
                text = sample(plain, cfg.sample_prompt, cfg.sample_tokens, self.seed, self.accelerator.device)
            else:
                text = "(no sample: the validation loss is not finite)"
        if hellaswag:
            from eval.hellaswag import evaluate_hellaswag

            scores = evaluate_hellaswag(plain, self.hellaswag_items, batch_size=cfg.eval_batch_size,
                                        accelerator=self.accelerator, bf16=bf16)
            results.update(hellaswag_acc=scores["acc"], hellaswag_acc_norm=scores["acc_norm"])
        _reshard(plain)
        plain.train()
        if self.accelerator.is_main_process:
            write(f"step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in results.items())
                  + (f"\n---\n{text}\n---" if text is not None else ""))
        return results

    def finite_loss(self, model: torch.nn.Module) -> bool:
        """Whether the current weights give a finite loss on the first validation window or example (the same
        answer on every rank: a cheap health check before weights are saved)."""
        plain = unwrapped(model)
        block = self.block_size
        first = self.val_tokens[:1] if self.pairs else self.val_tokens[:block + 1]
        loss = evaluate_loss(plain, first, block_size=block, batch_size=1,
                             accelerator=self.accelerator, bf16=self.accelerator.mixed_precision == "bf16")
        _reshard(plain)
        return math.isfinite(loss)


def _reshard(module: torch.nn.Module) -> None:
    """After forwards without a backward: FSDP2 keeps the root's parameters (embeddings, ln_f) gathered on every rank
    until the next backward; give them back now (checkpoint saves, the next step's forward gathers them again).
    Nothing for a module FSDP does not shard."""
    if hasattr(module, "reshard"):
        module.reshard()
