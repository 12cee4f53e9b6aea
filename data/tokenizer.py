"""GPT-2's byte-level BPE through tiktoken, built from the ranks file shipped in this folder.

Nothing is downloaded: HPC compute nodes are often air-gapped, and tests run offline. The file is
byte-identical to tiktoken's `r50k_base.tiktoken`, so ids equal `tiktoken.get_encoding("gpt2")`.
"""
from __future__ import annotations

import base64
import functools
import hashlib
from pathlib import Path

import tiktoken

from common.errors import UserError

RANKS_FILE = Path(__file__).with_name("gpt2.tiktoken")
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256
# The target id that the loss leaves out (F.cross_entropy's default ignore_index): prompt tokens of
# prompt/completion data, padding, and the context of HellaSwag rows. Not a token: no id is negative.
IGNORE = -100
N_VOCAB = 50257
TOKENIZER_NAME = "gpt2"  # the tokenizer every run reads and writes with, as a shard manifest records it
# GPT-2's pre-tokenization pattern (tiktoken's r50k_base / gpt2 encodings).
PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@functools.lru_cache(maxsize=1)
def load_ranks() -> dict[bytes, int]:
    """GPT-2's BPE as tiktoken stores it: token bytes -> rank (= token id), from the shipped, checked file."""
    raw = RANKS_FILE.read_bytes()
    if hashlib.sha256(raw).hexdigest() != RANKS_SHA256:
        raise RuntimeError(f"{RANKS_FILE} is corrupted (sha256 mismatch); restore it with `git checkout`")
    # Parsed here rather than with tiktoken.load, which would copy the file into a cache folder.
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in raw.splitlines() if line)}


@functools.lru_cache(maxsize=1)
def get_tokenizer() -> tiktoken.Encoding:
    """Return the GPT-2 `tiktoken.Encoding` (50,257 ids, `<|endoftext|>` = 50256), offline."""
    return tiktoken.Encoding(
        name=TOKENIZER_NAME,
        pat_str=PAT_STR,
        mergeable_ranks=load_ranks(),
        special_tokens={EOT_TOKEN: EOT_ID},
        explicit_n_vocab=N_VOCAB,
    )


def require_known_ids(max_id: int, vocab_size: int, tokens: str, model: str) -> None:
    """The one vocabulary check, wherever tokens meet a model (training, both evaluations, sampling): UserError
    unless every id of `tokens` (largest `max_id`) is one of the `vocab_size` ids `model` knows. Past them, a
    model's embedding fails with a long IndexError, or reads a padding row. `tokens` and `model` name the two
    in the message ("--dataset shards/x", "--init_from my_model")."""
    if max_id < vocab_size:
        return
    fix = (f"they are GPT-2 tokens: use a model with GPT-2's vocabulary of {N_VOCAB:,} ids" if max_id < N_VOCAB else
           f"they are not GPT-2 tokens (ids 0 to {N_VOCAB - 1:,}): make them with `python -m data.prepare`")
    raise UserError(f"{tokens} has token id {max_id:,}, but {model} knows only {vocab_size:,} token ids "
                    f"(0 to {vocab_size - 1:,}); {fix}")
