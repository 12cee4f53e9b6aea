"""The strided batch loader over a finite token stream (token shards, a local or embedded corpus).

The stream is cut into sequences j = tokens[j*T : j*T + T + 1] (neighbours share one token, so no
target is lost). A GLOBAL cursor counts sequences handed out; each `next_batch()` on any rank
takes the window [cursor, cursor + world_size*B) and rank r keeps rows [r*B, (r+1)*B), then the
cursor moves by world_size*B. So the sequences of an optimizer step (A*W*B of them) are the same
for any split into processes, micro-batches and accumulation steps; every rank gets a batch on every
call (the stream wraps into the next epoch) and the state is one integer, equal on all ranks.
Each epoch visits the sequences in an order that depends only on (seed, epoch).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from common.errors import UserError
from data.settings import DataMismatch, count_windows
from data.tokens import TokenStream

STATE_VERSION = 1
_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def permute_index(i: int, n: int, key: int) -> int:
    """A keyed bijection of [0, n): a 4-round Feistel network with cycle walking.

    O(1) memory, unlike materialising a permutation of 100M sequences on every rank.
    """
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half = bits // 2
    mask = (1 << half) - 1
    x = i
    while True:
        left, right = x >> half, x & mask
        for round_no in range(4):
            left, right = right, left ^ (_mix(right ^ _mix(key * 4 + round_no)) & mask)
        x = (left << half) | right
        if x < n:  # the Feistel permutes [0, 2**bits); walking the cycle lands back in [0, n)
            return x


class StridedLoader:
    """Per-rank batches of a token stream; see the module docstring for the order."""

    masked_targets = False  # packed text: every position of every row is a target

    def __init__(
        self,
        stream: TokenStream,
        *,
        block_size: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        source: str = "",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.stream = stream
        self.block_size = block_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.source = source
        self.n_sequences = count_windows(len(stream), block_size)
        if self.n_sequences < 1:
            raise UserError(
                f"{source or 'the dataset'} has {len(stream)} training tokens, fewer than block_size + 1 = "
                f"{block_size + 1}; use a larger corpus or a smaller --block_size"
            )
        self.cursor = 0

    def sequence_index(self, g: int) -> int:
        """Which sequence of the stream the g-th handed-out sequence (over all epochs) is."""
        epoch, i = divmod(g, self.n_sequences)
        if not self.shuffle:
            return i
        return permute_index(i, self.n_sequences, _mix(self.seed * 1_000_003 + epoch))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (x, y): int64 CPU tensors of shape (B, T), y = x shifted by one."""
        B, T = self.micro_batch_size, self.block_size
        first = self.cursor + self.rank * B
        rows = np.stack([self.stream.read(self.sequence_index(g) * T, T + 1) for g in range(first, first + B)])
        self.cursor += self.world_size * B
        rows = torch.from_numpy(rows.astype(np.int64))
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position; identical on every rank (the rank is kept for checks)."""
        return {
            "version": STATE_VERSION,
            "kind": "strided",
            "source": self.source,
            "cursor": self.cursor,
            "n_sequences": self.n_sequences,
            "block_size": self.block_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def close(self) -> None:
        """Nothing to let go: the rows are computed when asked for."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; any world size or micro-batch size may resume it."""
        if state.get("kind") != "strided":
            raise DataMismatch(f"data of kind {state.get('kind')!r} then, a token stream now")
        # Shard folders carry a content hash: re-prepared data with the same length is caught too. (A local
        # path is only a name, which may be spelled differently on resume, so it is not compared.)
        for key in ("block_size", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise UserError(
                    f"the saved data state has {key}={state.get(key)!r} but this run has {getattr(self, key)!r}; "
                    "resume with the same --block_size and --seed as the original run"
                )
        if str(state.get("source", "")).startswith("shards:") and state["source"] != self.source:
            raise DataMismatch(f"token shards {state['source']} then, {self.source} now")
        if state.get("n_sequences") != self.n_sequences:
            raise DataMismatch(f"{state.get('n_sequences')} windows of {self.block_size + 1} tokens then, "
                               f"{self.n_sequences} now")
        self.cursor = int(state["cursor"])
