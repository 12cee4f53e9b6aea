"""The GPT-2 network: pre-LN transformer blocks, learned positions, tied input/output embeddings.

Module and parameter names follow Hugging Face's GPT2LMHeadModel (`transformer.h.0.attn.c_attn`, ...). So
converting weights is a transpose of the four Conv1D matrices and nothing else (`model/state_dict_adapter.py`).
The architecture is `model/config.py`'s GPTConfig. Loading and exporting live in `model/pretrained.py`. This file
is only the network.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from checkpoint_io.weights import Weights
from data.tokenizer import EOT_ID, IGNORE
from model import pretrained
from model.config import GPTConfig
from model.loss import chunked_cross_entropy, cross_entropy

# One (key, value) pair per layer, each (B, n_head, T_cached, head_dim).
KVCache = list[tuple[torch.Tensor, torch.Tensor]]

class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_scaled_init = True  # see GPT._init_weights
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None):
        B, T, _ = x.shape
        # [q | k | v]. Under tensor parallelism they are this rank's heads' q, k and v (model/tensor_parallel.py).
        # So the number of heads is read from the projection's width, not from the config.
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        n_head = q.size(-1) // self.head_dim
        q, k, v = (t.view(B, T, n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        # With a cache, the new queries sit at the end of the key sequence. SDPA's is_causal aligns the mask to
        # the top-left corner. So the mask is built here (only when there is more than one query).
        mask, causal = None, past is None
        if past is not None and T > 1:
            S = k.size(2)
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, n_head * self.head_dim)
        return self.resid_dropout(self.c_proj(y)), (k, v)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_scaled_init = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 was trained with the tanh approximation of GELU (HF calls it "gelu_new").
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # GPT-2 uses eps=1e-5, which is also PyTorch's default.
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, past=None):
        a, kv = self.attn(self.ln_1(x), past)
        x = x + a
        return x + self.mlp(self.ln_2(x)), kv


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        V = config.padded_vocab_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, V, bias=False)
        # Recompute each block's activations in the backward pass (in training only). A setting of the run, not
        # of the architecture. It has no GPTConfig field, so it never reaches a checkpoint or an export.
        self.activation_checkpointing = False
        # The training loss's path (`model.loss`), also a setting of the run.
        #   0: the full logits and one F.cross_entropy.
        #   N > 0: the walk in chunks of N rows.
        #   None: the default of the device the forward runs on (`model.loss.default_loss_chunk_rows`).
        # None is resolved at each forward, from the hidden states: a model moved to a GPU gets the GPU's.
        # It may be set at any time (train.py's --loss_chunk_rows, a benchmark's variants). A compiled model
        # recompiles for a new value. Evaluation always walks chunks.
        self.loss_chunk_rows: int | None = None
        # Tied input/output embeddings, as in GPT-2: one matrix, saved once.
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # Padding rows are never looked up nor returned, and so get no gradient. They stay at zero, so an export,
        # which drops them, loses nothing.
        with torch.no_grad():
            self.transformer.wte.weight[config.vocab_size :].zero_()

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2 init: N(0, 0.02) everywhere. The projections that write into the residual stream (2 per block)
        # get std 0.02/sqrt(2*n_layer), so the stream's variance does not grow with depth.
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_scaled_init", False):
                std /= math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (tied weights once); by default without the position embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        loss_reduction: str = "mean",
        all_logits: bool = False,
        kv_cache: KVCache | None = None,
    ):
        """Return `(logits, loss)`.

        `targets` are the already-shifted next tokens (B, T), -100 = ignore.

        With targets, `logits` is None unless `all_logits=True`. A (B, T, V) fp32 tensor is the largest one in
        training, and the loss does not need it returned. (accelerate would also cast it to fp32 again.) Without
        targets: only the last position's logits (B, 1, V), or all positions with `all_logits=True`. Logits cover
        the real `vocab_size` ids only, never the padding rows.

        The loss's path, without `all_logits`:
          in training, the path `loss_chunk_rows` says (`model.loss.cross_entropy`: the full logits or chunks);
          in eval mode, `model.loss.chunked_cross_entropy`, with the output layer in fp32 as `_logits`.
        A per-token loss ("none") that needs gradients, or `all_logits`, takes F.cross_entropy over full logits.

        `kv_cache` (a list, filled in place) is for `generate`: pass `[]` to start one.
        """
        B, T = idx.shape
        past = kv_cache[0][0].size(2) if kv_cache else 0  # tokens already in the cache
        if past + T > self.config.block_size:
            raise ValueError(
                f"sequence of {past + T} tokens is longer than the model's block_size "
                f"{self.config.block_size}; crop the input to the last {self.config.block_size} tokens"
            )
        pos = torch.arange(past, past + T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        # Activation checkpointing: a block keeps only its input; the rest is recomputed in the backward pass.
        # Non-reentrant, so the recomputation restores the forward's RNG state: the same dropout masks. It also
        # works under torch.compile, DDP and FSDP2, and with inputs that need no gradient (LoRA's frozen embeddings).
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled() and kv_cache is None
        for i, block in enumerate(self.transformer.h):
            if recompute:
                x, _ = checkpoint(block, x, use_reentrant=False)
                continue
            x, kv = block(x, kv_cache[i] if past else None)
            if kv_cache is None:
                del kv  # views of the block's (B, T, 3C) projection: not kept through the next block
            else:
                if past:
                    kv_cache[i] = kv
                else:
                    kv_cache.append(kv)
        x = self.transformer.ln_f(x)
        V = self.config.vocab_size
        if targets is None:
            if not all_logits:
                x = x[:, [-1], :]  # generation only needs the next token: skip the other T-1 rows
            return self._logits(x)[..., :V].contiguous(), None
        if loss_reduction not in ("mean", "sum", "none"):
            raise ValueError(f"loss_reduction must be 'mean', 'sum' or 'none', not {loss_reduction!r}")
        weight = self.lm_head.weight
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if not all_logits and (loss_reduction != "none" or not needs_grad):
            # In training, the loss and its gradients on the run's path. In evaluation, chunk by chunk, never holding
            # the (B*T, V) logits. So the validation loss and HellaSwag's per-token scores peak no higher than a step.
            if self.training:
                return None, cross_entropy(x, weight, targets, V, loss_reduction, self.loss_chunk_rows)
            with torch.autocast(x.device.type, enabled=False):  # evaluation's output layer in fp32 (see _logits)
                return None, chunked_cross_entropy(x.float(), weight.float(), targets, V, loss_reduction)
        # The matmul runs over all padded rows: aligned sizes are what make it fast on tensor cores. A bias of -inf
        # on the padding columns, fused into the matmul, gives them no probability. So the loss is exactly the one
        # over the real vocabulary, and no (B, T, V) tensor is written twice. (Filling the slice in place instead
        # makes autograd clone the whole logits gradient.)
        pad_bias = None
        if self.config.padded_vocab_size > V:
            pad_bias = torch.zeros(self.config.padded_vocab_size, device=x.device, dtype=x.dtype)
            pad_bias[V:] = float("-inf")
        logits = self._logits(x, pad_bias)
        loss = F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE, reduction=loss_reduction
        )
        if loss_reduction == "none":
            loss = loss.view(B, T)
        return (logits[..., :V].contiguous() if all_logits else None), loss

    def _logits(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The output layer. Outside training it runs in fp32, even under bf16 autocast.

        GPT-2's logits sit around -100, where bf16 values are 0.5 apart. That is enough to move log-likelihood
        comparisons (HellaSwag)."""
        if self.training:
            return F.linear(x, self.lm_head.weight, bias)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.lm_head.weight.float(), None if bias is None else bias.float())

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append `max_new_tokens` sampled tokens to `idx` (B, T) and return the whole sequence.

        The tokens of `generate_stream` with the same arguments (and generator state), collected.
        """
        new = list(self.generate_stream(idx, max_new_tokens, temperature, top_k, top_p, use_cache, generator))
        return torch.cat([idx, *new], dim=1)

    @torch.no_grad()
    def generate_stream(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yield each of `max_new_tokens` new tokens (B, 1) as soon as it is sampled, continuing `idx` (B, T).

        `temperature=0` is greedy decoding. The KV cache makes each new token cost O(T) instead of a full forward
        pass. Past `block_size` the context slides (the last `block_size` tokens). That invalidates cached
        positions, so those steps run without the cache: the same tokens either way. Settings are checked on the
        first `next()`, before any forward pass.
        """
        if idx.size(1) == 0:
            raise ValueError(f"generate needs at least one prompt token; start from e.g. <|endoftext|> ({EOT_ID})")
        if temperature < 0 or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
            raise ValueError(
                f"invalid sampling settings temperature={temperature}, top_k={top_k}, top_p={top_p}; "
                "use temperature >= 0 (0 = greedy), top_k >= 1, 0 < top_p <= 1"
            )
        cache: KVCache | None = None
        for _ in range(max_new_tokens):
            fits = idx.size(1) <= self.config.block_size
            if use_cache and fits and cache:
                logits, _ = self(idx[:, -1:], kv_cache=cache)
            else:
                cache = [] if use_cache and fits else None
                logits, _ = self(idx[:, -self.config.block_size:], kv_cache=cache)
            idx_next = sample_next(logits[:, -1, :].float(), temperature, top_k, top_p, generator)
            idx = torch.cat((idx, idx_next), dim=1)
            yield idx_next

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), as PaLM's appendix B counts them.

        6N for the weights, plus 6 * 2 * n_layer * seq_len * n_embd for the attention scores and weighted sum.

        N counts the output projection (tied with wte) but not the position embeddings (a lookup)."""
        cfg = self.config
        T = seq_len or cfg.block_size
        return 6.0 * self.num_params(non_embedding=True) + 12.0 * cfg.n_layer * T * cfg.n_embd

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path | Weights, block_size: int | None = None,
                        dropout: float | None = None, revision: str | None = None) -> "GPT":
        """Load from a Hub id, a local HF GPT-2 folder, one of our run or checkpoint folders, or a LoRA checkpoint.

        `revision` is a Hub branch, tag or commit. A LoRA checkpoint loads as its base with the adapter merged in.
        The model is in eval mode (no dropout), as transformers' `from_pretrained` returns one. Call `.train()` to
        train it.

        `block_size` keeps the first positions (at most the weights' own); `dropout` replaces the saved rate."""
        return pretrained.load(cls, name_or_path, revision=revision, block_size=block_size, dropout=dropout)

    def save_pretrained(self, save_directory: str | Path, overwrite: bool = False) -> None:
        """Write a Hugging Face GPT-2 folder (weights, configs, tokenizer files) loadable by transformers."""
        pretrained.save_pretrained(self, save_directory, overwrite=overwrite)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row of `logits` (B, V); returns (B, 1)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # Nucleus: keep the smallest set of most likely tokens whose probability reaches top_p.
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum - sorted_logits.softmax(dim=-1) >= top_p  # mass before this token already enough
        drop = drop_sorted.scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
