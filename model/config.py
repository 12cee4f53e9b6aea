"""The architecture of a GPT: `GPTConfig`, and the named sizes: GPT-2's four, and three that train on a CPU."""
from __future__ import annotations

from dataclasses import dataclass

from data.tokenizer import N_VOCAB

# The output layer is the token embedding (tied, as in GPT-2): one tensor under two names. Checkpoints and exports
# hold it once, under TIED.
TIED = "transformer.wte.weight"
TIED_OUTPUT = "lm_head.weight"

SIZES: dict[str, dict[str, int]] = {
    # The four released GPT-2 sizes.
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
    # Small sizes that train in minutes on a laptop CPU.
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64),
    "mini": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "small": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
}


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = N_VOCAB  # GPT-2's BPE vocabulary
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2 has them
    pad_vocab_multiple: int = 64  # embedding rows rounded up to this (50257 -> 50304), 1 = none

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; pick sizes where it is")
        if min(self.block_size, self.vocab_size, self.n_layer, self.n_head, self.pad_vocab_multiple) < 1:
            raise ValueError(f"invalid model config {self}; sizes must be positive integers")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} is outside [0, 1); use e.g. 0.0 or 0.1")

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @classmethod
    def from_name(cls, name: str, **overrides) -> "GPTConfig":
        """Config of a named size (`gpt2` .. `gpt2-xl`, or `tiny`/`mini`/`small` for CPUs)."""
        if name not in SIZES:
            raise ValueError(f"unknown model size {name!r}; choose one of {', '.join(SIZES)}")
        return cls(**{**SIZES[name], **overrides})
