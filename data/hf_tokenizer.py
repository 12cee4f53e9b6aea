"""Hugging Face tokenizer files (vocab.json, merges.txt, tokenizer.json) rebuilt from tiktoken's ranks.

tiktoken stores GPT-2's BPE as "token bytes -> rank" only; HF's byte-level BPE wants the token
strings (bytes mapped to printable characters, GPT-2's byte-to-unicode table) and the ordered list
of merges. Both are derived here from `data/gpt2.tiktoken`, so an export ships the exact tokenizer
the model was trained with and nothing has to be downloaded.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from data.tokenizer import EOT_ID, EOT_TOKEN, load_ranks


@functools.lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> character table: printable Latin-1 bytes stand for themselves, the
    others (control characters, space, ...) are shifted to code points 256+ so that every token
    is a string of visible characters without whitespace (merges.txt is space-separated)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Split `token` the way byte-level BPE would, using only merges ranked below `max_rank`:
    start from single bytes and repeatedly merge the adjacent pair with the lowest rank."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < max_rank and (best_rank is None or rank < best_rank):
                best_rank, best_i = rank, i
        if best_rank is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list in rank order: token of rank r (>= 256) is the merge of the two parts that BPE
    reaches with the merges ranked below r (the last merge that creates it)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = _bpe_parts(ranks, token, rank)
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not a merge of two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


@functools.lru_cache(maxsize=1)  # about a second of work; exports in one process share it
def vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """HF-style vocabulary (token string -> id, ids = tiktoken ranks, plus <|endoftext|>) and merges."""
    table = byte_to_unicode()
    to_str = lambda token: "".join(table[b] for b in token)  # noqa: E731
    ranks = load_ranks()
    vocab = {to_str(token): rank for token, rank in ranks.items()}
    vocab[EOT_TOKEN] = EOT_ID
    merges = [(to_str(a), to_str(b)) for a, b in recover_merges(ranks)]
    return vocab, merges


def save_tokenizer(directory: str | Path, model_max_length: int) -> None:
    """Write vocab.json, merges.txt, tokenizer.json and tokenizer_config.json into `directory`."""
    from transformers import GPT2Tokenizer

    directory = Path(directory)
    vocab, merges = vocab_and_merges()
    # The classic files, for older transformers versions and other BPE implementations.
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_text = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    (directory / "merges.txt").write_text(merges_text, encoding="utf-8")
    # tokenizer.json and tokenizer_config.json through transformers itself, so they match what the
    # installed AutoTokenizer expects (special tokens, no prefix space, as GPT-2 was trained).
    tok = GPT2Tokenizer(vocab=vocab, merges=merges, add_prefix_space=False, model_max_length=model_max_length)
    tok.save_pretrained(str(directory))
