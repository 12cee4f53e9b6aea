"""A run's six data settings (`DataConfig`, with their defaults and help), and the validation-window rule: the
facts about data that need no data. Light on purpose (no torch, no tokenizer): `configs` takes the data group
and its parse-time check from here, and `data.source` turns the settings into a source.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import UserError
from common.resume_rules import ACCEPTED, CHECKED, flag

SHAKESPEARE = "shakespeare"  # `--dataset` for the embedded Tiny Shakespeare


@dataclass(frozen=True)
class DataConfig:
    """What `--dataset` and its five companion flags say, with their defaults: the data group of train.py's
    configuration (`configs`), and what `eval.val_loss` and `data.prepare` read a dataset with. Their one home:
    the flags and the keys of config.yaml have these names and take these defaults."""

    _argument_group_name = "data"

    dataset: str = flag(SHAKESPEARE, "'shakespeare', a local .txt/.jsonl/.parquet file/glob/folder, a shard "
                                     "folder, or a Hub id[:config]", CHECKED)
    text_column: str = flag("text", "column holding the text in .jsonl/.parquet files and Hub datasets", CHECKED)
    prompt_field: str = flag("prompt", "prompt field of prompt/completion .jsonl data (a .jsonl whose first record "
                                       "has it and --completion_field; the loss counts only completion tokens)",
                             CHECKED)
    completion_field: str = flag("completion", "completion field of prompt/completion .jsonl data", CHECKED)
    dataset_config: str | None = flag(None, "Hub dataset config name; default: the one given after ':' in "
                                            "--dataset, or the dataset's default", CHECKED)
    val_tokens: int = flag(8_192, "size of the fixed validation set, in tokens", ACCEPTED)

    def __post_init__(self) -> None:
        if self.val_tokens <= 0:
            raise UserError(f"--val_tokens must be positive, got {self.val_tokens}; pass a value of at least 1")
        for name in ("dataset", "text_column", "prompt_field", "completion_field"):
            if not getattr(self, name).strip():
                raise UserError(f"--{name} is empty; pass a value (default: {getattr(DataConfig, name)!r})")
        if self.dataset_config is not None and not self.dataset_config.strip():
            raise UserError("--dataset_config is empty; pass a value or leave the flag out")


class DataMismatch(UserError):
    """A loader's saved position is for other data than the loader reads now (another dataset, changed files, another
    kind): `detail` says how (`9,506 windows of 129 tokens then, 170 now`). The message adds the generic way out; a
    trainer that knows the checkpoint and the data it recorded says more (`training.checkpoints.checkpoint.restore`)."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"the saved data position is for other data ({detail}); resume with the same --dataset, "
                         "unchanged, as the original run")
        self.detail = detail


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


def check_val_tokens(val_tokens: int, block_size: int, flag: str = "--val_tokens", block_flag: str | None = None,
                     block_changed: bool = False) -> None:
    """The same rule for the cap, before any data is read: a cap below one window could never be scored,
    whatever the dataset (configs calls this when it parses the flags; `flag` names the cap's flag). `block_flag`:
    the flag that sets the block size, where the caller has one, also named as a way out; `block_changed`: the
    block size is what the user changed (the cap is its default), so its line leads with it."""
    if count_windows(val_tokens, block_size) >= 1:
        return
    more = f"{flag} {block_size + 1} or more"
    if block_flag is None or val_tokens < 2:
        raise UserError(f"{flag} {val_tokens} is less than one validation window (block_size + 1 = "
                        f"{block_size + 1}); pass {more}")
    less = f"a {block_flag} of at most {val_tokens - 1}"
    if block_changed:
        raise UserError(f"{block_flag} {block_size} needs a validation window of block_size + 1 = {block_size + 1} "
                        f"tokens, more than {flag} {val_tokens}; pass {less}, or {more}")
    raise UserError(f"{flag} {val_tokens} is less than one validation window (block_size + 1 = {block_size + 1}); "
                    f"pass {more}, or {less}")
