"""A run's six data settings with their defaults, and the validation-window rule: the facts about data that
need no data. Light on purpose (no torch, no tokenizer): `configs` takes its defaults and its parse-time check
from here, and `data.source` turns the settings into a source.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import UserError

SHAKESPEARE = "shakespeare"  # `--dataset` for the embedded Tiny Shakespeare


@dataclass(frozen=True)
class DataSettings:
    """What `--dataset` and its five companion flags say, with their defaults (their one home: the flags of
    train.py and eval.val_loss and the keys of config.yaml have these names and take these defaults)."""

    dataset: str = SHAKESPEARE
    dataset_config: str | None = None  # a Hub dataset's config; None: the one after ':' in `dataset`, if any
    text_column: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    val_tokens: int = 8_192  # the validation set's cap, in tokens


def count_windows(n_tokens: int, block_size: int) -> int:
    """How many windows of block_size + 1 tokens (block_size inputs and their targets, shifted by one) a stream
    of `n_tokens` holds, consecutive windows sharing one token so that no target is lost: the training sequences
    of a token stream and the windows a validation loss scores. Zero: not even one."""
    return max(0, (n_tokens - 1) // block_size)


def require_a_window(n_tokens: int, block_size: int, fix: str) -> None:
    """The validation-window rule: a validation set shorter than one window scores nothing, so it is refused
    (UserError ending in `fix`, what makes it long enough for that source or caller)."""
    if count_windows(n_tokens, block_size) < 1:
        raise UserError(f"the validation set has {n_tokens} tokens, fewer than one window of block_size + 1 = "
                        f"{block_size + 1}; {fix}")


def check_val_tokens(val_tokens: int, block_size: int, flag: str = "--val_tokens") -> None:
    """The same rule for the cap, before any data is read: a cap below one window could never be scored,
    whatever the dataset (configs calls this when it parses the flags; `flag` names the cap's flag)."""
    if count_windows(val_tokens, block_size) < 1:
        raise UserError(f"{flag} {val_tokens} is less than one validation window (block_size + 1 = "
                        f"{block_size + 1}); pass {flag} {block_size + 1} or more")
