"""Validation loss on the run's fixed held-out tokens (or held-out examples), with a short text sample."""
from __future__ import annotations

import math
from typing import Any

import torch

from data import get_tokenizer
from eval.val_loss import evaluate_loss
from model import GPT
from training.evaluations.spec import Context, EvaluationSpec, Metric


def sample(model: GPT, prompt: str, max_new_tokens: int, seed: int, device: torch.device) -> str:
    """A short sample from a fixed seed, drawn without disturbing the training RNG streams."""
    enc = get_tokenizer()
    ids = torch.tensor([enc.encode(prompt, allowed_special="all")], device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        out = model.generate(ids, max_new_tokens=max_new_tokens, temperature=1.0, top_k=200)
    return enc.decode(out[0].tolist())


def load(ctx: Context) -> Any:
    """The validation tokens (a stream's fixed set) or examples. A set shorter than one window is refused."""
    return ctx.source.val_set(ctx.block_size)


def score(plain: torch.nn.Module, val_tokens: Any, ctx: Context, bf16: bool) -> tuple[dict[str, float], str | None]:
    cfg = ctx.cfg
    loss = evaluate_loss(plain, val_tokens, block_size=ctx.block_size, batch_size=cfg.eval_batch_size,
                         accelerator=ctx.accelerator, bf16=bf16)
    # Sampling from non-finite logits would fail inside torch.multinomial. --sample_tokens 0: no sample.
    if not cfg.sample_tokens:
        text = None
    elif math.isfinite(loss):
        text = sample(plain, cfg.sample_prompt, cfg.sample_tokens, ctx.seed, ctx.accelerator.device)
    else:
        text = "(no sample: the validation loss is not finite)"
    return {"val_loss": loss}, text


SPEC = EvaluationSpec(
    name="validation", display="validation loss", flags=("eval_every", "sample_tokens", "sample_prompt"),
    metrics=(Metric("val_loss", "validation loss", "loss", "cross-entropy (nats/token)", "val loss"),),
    every=lambda cfg: cfg.eval_every, load=load, score=score,
    planned=lambda batch, block: (batch, block, f"{batch} windows x {block} tokens, no gradients"),
)
