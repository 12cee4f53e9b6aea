"""HellaSwag accuracy (acc and acc_norm) on a fixed set of items, scored as `python -m eval.hellaswag` scores them.

Only a run that scores it imports `eval.hellaswag`, which needs the `evaluate` package."""
from __future__ import annotations

from typing import Any

import torch

from training.evaluations.spec import Context, EvaluationSpec, Metric

# The longest row a batch pads to: the longest validation item (150 tokens of context + ending) rounded up to
# eval.hellaswag's padding multiple of 16.
ROW_TOKENS = 160
# What scoring it adds to a CPU process's resident set: the `evaluate` package and the items. Measured:
# docs/benchmarks.md, "The whole run, phase by phase".
PROCESS_BYTES = int(0.28 * 2**30)


def load(ctx: Context) -> Any:
    from eval.hellaswag import load_items, require_metric_packages

    require_metric_packages()
    return load_items(ctx.cfg.hellaswag_data, ctx.cfg.hellaswag_limit, flag="--hellaswag_data",
                      limit_flag="--hellaswag_limit")


def score(plain: torch.nn.Module, items: Any, ctx: Context, bf16: bool) -> tuple[dict[str, float], str | None]:
    from eval.hellaswag import evaluate_hellaswag

    scores = evaluate_hellaswag(plain, items, batch_size=ctx.cfg.eval_batch_size, accelerator=ctx.accelerator,
                                bf16=bf16)
    return {"hellaswag_acc": scores["acc"], "hellaswag_acc_norm": scores["acc_norm"]}, None


def planned(batch: int, block: int) -> tuple[int, int, str]:
    tokens = min(ROW_TOKENS, block)
    return 4 * batch, tokens, f"{batch} items x 4 endings x {tokens} tokens"


SPEC = EvaluationSpec(
    name="hellaswag", display="HellaSwag", flags=("hellaswag_every", "hellaswag_data", "hellaswag_limit"),
    metrics=(Metric("hellaswag_acc", "HellaSwag acc", "HellaSwag", "accuracy", "acc"),
             Metric("hellaswag_acc_norm", "HellaSwag acc_norm", "HellaSwag", "accuracy", "acc_norm")),
    every=lambda cfg: cfg.hellaswag_every, load=load, score=score, planned=planned, cpu_process_bytes=PROCESS_BYTES,
)
