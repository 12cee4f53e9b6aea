"""Tokenization into GPT-2 ids and random access to a long token stream made of several arrays.

Every document is encoded with `encode_ordinary` (a literal "<|endoftext|>" in the text stays
text) and followed by one end-of-text token, so the packed stream decodes to the documents joined
by "<|endoftext|>" (plus a final one). Ids are stored as uint16: GPT-2's 50,257 ids fit.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from data.tokenizer import EOT_ID, get_tokenizer

TOKEN_DTYPE = np.uint16


def default_threads() -> int:
    """Threads for tokenization: tiktoken releases the GIL, so one per available core."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS has no sched_getaffinity
        return max(1, os.cpu_count() or 1)


def encode_documents(texts: Sequence[str], num_threads: int | None = None) -> np.ndarray:
    """Encode documents in parallel threads; return one uint16 array, each document + EOT."""
    if not texts:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    enc = get_tokenizer()
    threads = num_threads or default_threads()
    ids = enc.encode_ordinary_batch(list(texts), num_threads=threads)
    lengths = np.fromiter((len(t) + 1 for t in ids), dtype=np.int64, count=len(ids))
    out = np.empty(int(lengths.sum()), dtype=TOKEN_DTYPE)
    pos = 0
    for doc in ids:
        out[pos : pos + len(doc)] = doc
        pos += len(doc)
        out[pos] = EOT_ID
        pos += 1
    return out


class TokenStream:
    """Several 1-D token arrays (in memory or np.memmap) read as one concatenated stream."""

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        self.arrays = [a for a in arrays if len(a) > 0]
        sizes = np.array([len(a) for a in self.arrays], dtype=np.int64)
        # starts[i] is the stream position of arrays[i][0]; starts[-1] is the total length.
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream; a read may span array boundaries."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"read [{start}, {start + length}) outside a stream of {len(self)} tokens")
        out = np.empty(length, dtype=TOKEN_DTYPE)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            offset = start + filled - int(self.starts[i])
            piece = self.arrays[i][offset : offset + length - filled]
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
            i += 1
        return out
