"""Hugging Face tokenizer files (vocab.json, merges.txt, tokenizer.json) rebuilt from tiktoken's ranks.

tiktoken stores GPT-2's BPE as "token bytes -> rank" only; HF's byte-level BPE wants the token
strings (bytes mapped to printable characters, GPT-2's byte-to-unicode table) and the ordered list
of merges. Both are derived here from `data/gpt2.tiktoken`, so an export ships the exact tokenizer
the model was trained with and nothing has to be downloaded.
"""
from __future__ import annotations

import functools
import hashlib
import json
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path

from common.atomic import TEMP_PREFIX
from common.cache_dir import cache_dir
from data.tokenizer import EOT_ID, EOT_TOKEN, RANKS_SHA256, load_ranks


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


TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json")


def save_tokenizer(directory: str | Path, model_max_length: int) -> None:
    """Write vocab.json, merges.txt, tokenizer.json and tokenizer_config.json into `directory`: copies of this
    machine's cached set for `model_max_length` (`common.cache_dir`), built there by the first export that needs it;
    built in `directory` itself when the cache cannot be written. Building costs 0.7 CPU-s of a small run's 5."""
    directory = Path(directory)
    cached = _cached_tokenizer(model_max_length)
    try:
        if cached is not None:
            for name in TOKENIZER_FILES:
                shutil.copyfile(cached / name, directory / name)
            return
    except FileNotFoundError:  # another process replaced a damaged cached folder while this one copied it
        pass
    _build_tokenizer(directory, model_max_length)


def _cached_tokenizer(model_max_length: int) -> Path | None:
    """The cached folder of the tokenizer files for `model_max_length`, built if missing; None if it cannot be.

    Its name holds everything the files depend on: the ranks, this module's code, the versions of transformers and
    tokenizers that write them, and `model_max_length`. So a changed input is a new folder, never a stale copy.
    A folder appears complete or not at all (built under a temporary name, then renamed); of two processes that
    build it at once, the first rename wins and the other's copy is discarded. A damaged one (a file deleted) is
    replaced."""
    key = hashlib.sha256(RANKS_SHA256.encode() + Path(__file__).read_bytes())
    key.update(f"{version('transformers')} {version('tokenizers')} {model_max_length}".encode())
    folder = cache_dir() / f"hf-tokenizer-{key.hexdigest()[:16]}"
    if _complete(folder):
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=folder.parent))
    except OSError:  # a read-only home, a full disk: the export builds its own
        return None
    try:
        _build_tokenizer(building, model_max_length)
        if folder.exists() and not _complete(folder):
            shutil.rmtree(folder)
        building.rename(folder)
    except OSError:
        pass  # another process renamed its copy first (or the disk is full): what is there is checked below
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return folder if _complete(folder) else None


def _complete(folder: Path) -> bool:
    """Every file there and not empty (a crash of the machine may leave a renamed file empty)."""
    return all((folder / name).is_file() and (folder / name).stat().st_size for name in TOKENIZER_FILES)


def _build_tokenizer(directory: Path, model_max_length: int) -> None:
    """The four files, built from the ranks (`vocab_and_merges`) and written by transformers."""
    from transformers import GPT2Tokenizer

    vocab, merges = vocab_and_merges()
    # The classic files, for older transformers versions and other BPE implementations.
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_text = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    (directory / "merges.txt").write_text(merges_text, encoding="utf-8")
    # tokenizer.json and tokenizer_config.json through transformers itself, so they match what the
    # installed AutoTokenizer expects (special tokens, no prefix space, as GPT-2 was trained).
    tok = GPT2Tokenizer(vocab=vocab, merges=merges, add_prefix_space=False, model_max_length=model_max_length)
    tok.save_pretrained(str(directory))
