"""A checkpoint's state read whole, whatever engine wrote it: what a move reads from one engine's format and writes
into another's (`training.checkpoints.moving`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common.errors import UserError
from model.config import TIED, TIED_OUTPUT

_TIED_PAIR = {TIED: TIED_OUTPUT, TIED_OUTPUT: TIED}


@dataclass
class WholeState:
    """A checkpoint's state, whole, by our GPT's parameter names, c_attn in Hugging Face's order: `weights`, and each
    optimizer's state per parameter (AdamW: exp_avg, exp_avg_sq, step; Muon: momentum_buffer)."""

    weights: dict[str, torch.Tensor]
    optimizers: list[dict[str, dict[str, Any]]]

    def weight(self, name: str) -> torch.Tensor:
        """The weight `name`; the token embedding and the output layer are one tensor (tied)."""
        found = self.weights.get(name, self.weights.get(_TIED_PAIR.get(name, "")))
        if found is None:
            raise UserError(f"the checkpoint holds no weight {name}; resume it with the model it was saved with")
        return found

    def state(self, index: int, name: str) -> dict[str, Any] | None:
        states = self.optimizers[index]
        return states.get(name, states.get(_TIED_PAIR.get(name, "")))
