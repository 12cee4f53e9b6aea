"""Our GPT cut into pipeline stages: whole blocks on each stage.

The embeddings are on the first stage; the final LayerNorm and the tied output layer on the last.

`GPTStage` takes its modules from a built `GPT`. The model is built whole, then cut: every stage starts from the
same initial weights. A stage keeps the full model's parameter names (`transformer.h.5.attn.c_attn.weight` on the
stage that holds block 5). So a stage's state dict is a slice of the whole model's, and the whole one is their
union. The output layer is tied to the token embedding. A last stage that is not also the first holds its own copy
of `wte` under the same name. Summing their gradients keeps it equal to the first stage's
(`training.distributed.pipeline`).

Invariants:
- The stages' blocks are consecutive and cover every block once. When the blocks do not divide evenly, the earlier
  stages hold one more.
- A stage's forward takes the previous stage's output (token ids on the first). It returns the residual stream
  (the last: after `ln_f`).
- `loss` is the model's loss on that output.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.loss import chunked_cross_entropy, cross_entropy


def stage_blocks(n_layer: int, stages: int) -> list[range]:
    """The blocks of each stage: consecutive, as even as they divide, the earlier stages one more."""
    if not 1 <= stages <= n_layer:
        raise ValueError(f"{stages} stages for {n_layer} blocks; use 1 to {n_layer}")
    size, extra = divmod(n_layer, stages)
    starts = [s * size + min(s, extra) for s in range(stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(stages)]


class GPTStage(nn.Module):
    """Stage `stage` of `stages` of `model`. It takes `model`'s modules: `model` is not usable afterwards."""

    def __init__(self, model: nn.Module, stage: int, stages: int) -> None:
        super().__init__()
        self.config, self.stage, self.stages = model.config, stage, stages
        self.first, self.last = stage == 0, stage == stages - 1
        self.blocks = stage_blocks(model.config.n_layer, stages)[stage]
        parts = {"h": nn.ModuleDict({str(i): model.transformer.h[i] for i in self.blocks})}
        if self.first:
            parts.update(wte=model.transformer.wte, wpe=model.transformer.wpe, drop=model.transformer.drop)
        if self.last:
            parts["ln_f"] = model.transformer.ln_f
            if not self.first:  # the output layer's weight: a copy of the tied embedding, under its name
                parts["wte"] = nn.Embedding.from_pretrained(model.transformer.wte.weight.detach().clone(),
                                                            freeze=False)
        self.transformer = nn.ModuleDict(parts)
        self.activation_checkpointing = False  # as `GPT.activation_checkpointing`: blocks recomputed in the backward
        self.loss_chunk_rows = model.loss_chunk_rows  # as `GPT.loss_chunk_rows`, for the last stage's loss

    @property
    def output_weight(self) -> torch.Tensor:
        """The output layer's weight (the last stage's; tied to the token embedding)."""
        return self.transformer.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.size(1), dtype=torch.long, device=x.device)
            x = self.transformer.drop(self.transformer.wte(x) + self.transformer.wpe(pos))
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.transformer.h.values():
            x, _ = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.transformer.ln_f(x) if self.last else x

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The loss of the last stage's output, as `GPT.forward` computes it.

        In training, on the path `loss_chunk_rows` says. In evaluation, chunked, with the output layer in fp32."""
        V = self.config.vocab_size
        if self.training:
            return cross_entropy(hidden, self.output_weight, targets, V, reduction, self.loss_chunk_rows)
        with torch.autocast(hidden.device.type, enabled=False):
            return chunked_cross_entropy(hidden.float(), self.output_weight.float(), targets, V, reduction)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last position's logits over the real vocabulary (generation), in fp32 as `GPT` computes them."""
        with torch.autocast(hidden.device.type, enabled=False):
            return (hidden[:, [-1], :].float() @ self.output_weight.float().T)[..., :self.config.vocab_size]
