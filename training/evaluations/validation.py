"""Validation loss on the run's fixed held-out tokens (or held-out examples), with a short text sample.

Its flags are the run's own evaluation schedule (`--eval_every`) and the sample's. The scoring imports torch only
when it runs, so train.py's command line reads the flags without it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.errors import UserError
from common.resume_rules import ACCEPTED, flag
from training.evaluations.spec import Context, EvaluationSpec, Metric

if TYPE_CHECKING:
    import torch

    from model import GPT


@dataclass
class ValidationFlags:
    """When the validation loss is scored, and the sample printed under it."""

    _argument_group_name = "validation loss"

    eval_every: int = flag(160, "validation loss and a sample every N steps (and at the last)", ACCEPTED)
    sample_tokens: int = flag(64, "tokens of the text sample printed at each evaluation; 0 = no sample", ACCEPTED)
    sample_prompt: str = flag("\n", "prompt of that sample", ACCEPTED)

    def __post_init__(self) -> None:
        if self.eval_every <= 0:
            raise UserError(f"--eval_every must be positive, got {self.eval_every}; pass a value of at least 1")
        if self.sample_tokens < 0:
            raise UserError(f"--sample_tokens must be 0 or more, got {self.sample_tokens}; pass 0 to turn it off")
        if not self.sample_prompt:
            raise UserError("sample_prompt is empty; pass at least one character, e.g. --sample_prompt '\\n' "
                            "(the default)")


def sample(model: GPT, prompt: str, max_new_tokens: int, seed: int, device: torch.device) -> str:
    """A short sample from a fixed seed, drawn without disturbing the training RNG streams."""
    import torch

    from data import get_tokenizer

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
    from eval.val_loss import evaluate_loss

    own = ctx.flags
    loss = evaluate_loss(plain, val_tokens, block_size=ctx.block_size, batch_size=ctx.batch_size,
                         accelerator=ctx.accelerator, bf16=bf16)
    # Sampling from non-finite logits would fail inside torch.multinomial. --sample_tokens 0: no sample.
    if not own.sample_tokens:
        text = None
    elif math.isfinite(loss):
        text = sample(plain, own.sample_prompt, own.sample_tokens, ctx.seed, ctx.accelerator.device)
    else:
        text = "(no sample: the validation loss is not finite)"
    return {"val_loss": loss}, text


SPEC = EvaluationSpec(
    name="validation", display="validation loss", flags=ValidationFlags,
    metrics=(Metric("val_loss", "validation loss", "loss", "cross-entropy (nats/token)", "val loss"),),
    every=lambda own: own.eval_every, load=load, score=score,
    planned=lambda batch, block: (batch, block, f"{batch} windows x {block} tokens, no gradients"),
)
