"""HellaSwag accuracy (acc and acc_norm) on a fixed set of items, scored as `python -m eval.hellaswag` scores them.

Only a run that scores it imports `eval.hellaswag`, which needs the `evaluate` package."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import UserError
from common.resume_rules import ACCEPTED, flag
from training.evaluations.spec import Context, EvaluationSpec, Metric

if TYPE_CHECKING:
    import torch

# The longest row a batch pads to: the longest validation item (150 tokens of context + ending) rounded up to
# eval.hellaswag's padding multiple of 16.
ROW_TOKENS = 160
# What scoring it adds to a CPU process's resident set: the `evaluate` package and the items. Measured:
# docs/benchmarks.md, "The whole run, phase by phase".
PROCESS_BYTES = int(0.28 * 2**30)


@dataclass
class HellaSwagFlags:
    """When HellaSwag is scored, and on which items."""

    _argument_group_name = "HellaSwag"

    hellaswag_every: int = flag(0, "HellaSwag every N steps; 0 = never; needs the eval package", ACCEPTED)
    hellaswag_data: str | None = flag(None, "local HellaSwag jsonl; default: the Hub split", ACCEPTED)
    hellaswag_limit: int | None = flag(None, "score only the first N HellaSwag items; default: all 10,042", ACCEPTED)

    def __post_init__(self) -> None:
        if self.hellaswag_every < 0:
            raise UserError(f"--hellaswag_every must be 0 or more, got {self.hellaswag_every}; pass 0 to turn it off")
        if self.hellaswag_data is not None and not self.hellaswag_data.strip():
            raise UserError("--hellaswag_data is empty; pass a value or leave the flag out")
        if self.hellaswag_limit is not None and self.hellaswag_limit < 1:
            raise UserError(f"--hellaswag_limit must be at least 1, got {self.hellaswag_limit}; leave it out to "
                            "score every item")
        if self.hellaswag_data is not None and not Path(self.hellaswag_data).expanduser().is_file():
            kind = "a folder" if Path(self.hellaswag_data).expanduser().is_dir() else "not an existing file"
            raise UserError(f"--hellaswag_data {self.hellaswag_data} is {kind}; pass a HellaSwag .jsonl or .jsonl.gz "
                            "file, or leave it out to use the Hub copy")


def load(ctx: Context) -> Any:
    from eval.hellaswag import load_items, require_metric_packages

    require_metric_packages()
    return load_items(ctx.flags.hellaswag_data, ctx.flags.hellaswag_limit, flag="--hellaswag_data",
                      limit_flag="--hellaswag_limit")


def score(plain: torch.nn.Module, items: Any, ctx: Context, bf16: bool) -> tuple[dict[str, float], str | None]:
    from eval.hellaswag import evaluate_hellaswag

    scores = evaluate_hellaswag(plain, items, batch_size=ctx.batch_size, accelerator=ctx.accelerator, bf16=bf16)
    return {"hellaswag_acc": scores["acc"], "hellaswag_acc_norm": scores["acc_norm"]}, None


def planned(batch: int, block: int) -> tuple[int, int, str]:
    tokens = min(ROW_TOKENS, block)
    return 4 * batch, tokens, f"{batch} items x 4 endings x {tokens} tokens"


def next_command(run: str, own: HellaSwagFlags) -> str:
    """`python -m eval.hellaswag` on the final model. It runs as written, offline too: on the run's
    `--hellaswag_data`, else on the items the repository ships, not the Hub."""
    if own.hellaswag_data:
        data = f"--data {own.hellaswag_data}"
    else:
        from eval.hellaswag_data import SAMPLE_FILE

        shown = os.path.relpath(SAMPLE_FILE)
        items = len(SAMPLE_FILE.read_text().splitlines())
        data = (f"--data {SAMPLE_FILE if shown.startswith('..') else shown} ({items} shipped items, a try; "
                "without --data, the Hub's validation set)")
    return f"python -m eval.hellaswag --model {run} {data}"


SPEC = EvaluationSpec(
    name="hellaswag", display="HellaSwag", flags=HellaSwagFlags,
    metrics=(Metric("hellaswag_acc", "HellaSwag acc", "HellaSwag", "accuracy", "acc"),
             Metric("hellaswag_acc_norm", "HellaSwag acc_norm", "HellaSwag", "accuracy", "acc_norm")),
    every=lambda own: own.hellaswag_every, load=load, score=score, planned=planned,
    card_note="HellaSwag is zero-shot, scored by completion likelihood (acc_norm: per-character normalised)",
    next_command=next_command, cpu_process_bytes=PROCESS_BYTES,
)
