"""HellaSwag items: loading (Hub or local jsonl[.gz]), checking, and the harness's text preprocessing.

The prompt format follows EleutherAI's lm-evaluation-harness `hellaswag` task
(lm_eval/tasks/hellaswag/utils.py: `preprocess` and `process_docs`), so scores are comparable with
its published numbers.
"""
from __future__ import annotations

import gzip
import json
import re
import zlib
from pathlib import Path
from typing import Any

from common.errors import UserError, json_problem
from common.network import offline_mode, reaching_the_hub

HUB_DATASET = "Rowan/hellaswag"
# A few HellaSwag items shipped with the repository (the tests' fixture): `--data` for a try of eval.hellaswag that
# needs no network; a smoke check, not a score (the validation set has 10,042 items).
SAMPLE_FILE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "eval" / "hellaswag_tiny.jsonl"
N_ENDINGS = 4
_MARKER = re.compile(r"\[.*?\]")


def preprocess(text: str) -> str:
    """The harness's cleanup of WikiHow artefacts, step for step (order matters)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = _MARKER.sub("", text)  # [header], [step], [substeps], ... (non-greedy: one at a time)
    return text.replace("  ", " ")  # a single pass, as in the harness (not a loop)


def query_and_choices(item: dict[str, Any]) -> tuple[str, list[str]]:
    """The harness's context string and the four preprocessed endings (without delimiter)."""
    if "ctx_a" in item:
        # str.capitalize also lowercases the rest of ctx_b: a harness quirk, kept for parity.
        ctx = item["ctx_a"] + " " + item["ctx_b"].capitalize()
    else:  # items that only carry the joined `ctx` (e.g. the approximate offline copy)
        ctx = item["ctx"]
    query = preprocess(item["activity_label"] + ": " + ctx)
    return query, [preprocess(ending) for ending in item["endings"]]


def check_item(item: Any, where: str) -> dict[str, Any]:
    """Validate one item's fields; return it with `label` as an int."""
    if not isinstance(item, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(item).__name__}; "
                        "use one HellaSwag item per line")
    has_ctx = isinstance(item.get("ctx"), str) or (
        isinstance(item.get("ctx_a"), str) and isinstance(item.get("ctx_b"), str))
    missing = [k for k in ("activity_label", "endings", "label") if k not in item]
    if missing or not has_ctx:
        missing += [] if has_ctx else ["ctx (or ctx_a and ctx_b)"]
        raise UserError(f"{where}: missing field(s) {', '.join(missing)}; HellaSwag items need "
                        "activity_label, ctx (or ctx_a/ctx_b), endings and label")
    endings = item["endings"]
    if (not isinstance(endings, list) or len(endings) != N_ENDINGS
            or not all(isinstance(e, str) for e in endings)):
        raise UserError(f"{where}: `endings` must be a list of {N_ENDINGS} strings; fix the item")
    if not isinstance(item["activity_label"], str):
        raise UserError(f"{where}: `activity_label` must be a string; fix the item")
    label = item["label"]
    try:
        label = int(label)  # the Hub copy stores labels as strings ("0".."3")
    except (TypeError, ValueError):
        label = None
    if label is None or isinstance(item["label"], (bool, float)) or not 0 <= label < N_ENDINGS:
        raise UserError(f"{where}: label {item['label']!r} is not an ending index 0-{N_ENDINGS - 1}; "
                        "fix the item (test-split items have no labels and cannot be scored)")
    return {**item, "label": label}


def _read_jsonl(path: Path) -> list[Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise UserError(f"{path}:{lineno}: not valid JSON ({json_problem(err)}); "
                                        "the file must hold one JSON object per line") from err
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:  # cut short by a download, or not gzip at all
        raise UserError(f"{path} is a truncated or damaged gzip file ({err}); download it again, or pass the "
                        "uncompressed .jsonl") from err
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read {path} ({err}); pass a jsonl or jsonl.gz file") from err
    return rows


def _load_hub(flag: str) -> list[Any]:
    try:
        import datasets
    except ImportError as err:
        raise UserError("the `datasets` package is needed to fetch HellaSwag from the Hub; "
                        f"install it or pass a local jsonl with {flag}") from err
    try:
        with reaching_the_hub(f"load {HUB_DATASET}", f"pass a local HellaSwag jsonl with {flag}"):
            if not offline_mode():  # one request first: a Hub out of reach answers at once, where datasets'
                from huggingface_hub import HfApi  # download retries for about 25 s before it says so

                HfApi().dataset_info(HUB_DATASET)
            return list(datasets.load_dataset(HUB_DATASET, split="validation"))
    except UserError:
        raise
    except Exception as err:  # gated, renamed, a changed format: all end in the same advice
        raise UserError(f"cannot load {HUB_DATASET} from the Hub ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}); "
                        f"pass a local HellaSwag jsonl with {flag}") from err


def load_items(path: str | Path | None = None, limit: int | None = None, flag: str = "--data",
               limit_flag: str = "--limit") -> list[dict[str, Any]]:
    """HellaSwag validation items from a local .jsonl/.jsonl.gz, or from the Hub when path is None.
    `flag`, `limit_flag`: the caller's options that pass `path` and `limit`, named in the advice (train.py's are
    --hellaswag_data and --hellaswag_limit).

    Every item is checked (fields, four endings, label 0-3); `limit` keeps the first N items.
    """
    if limit is not None and limit < 1:
        raise UserError(f"{limit_flag} must be at least 1, got {limit}; leave it out to use every item")
    if path is None:
        rows, source = _load_hub(flag), HUB_DATASET
    else:
        file = Path(path)
        if not file.is_file():
            raise UserError(f"HellaSwag file {file} does not exist; pass a jsonl or jsonl.gz file "
                            f"(or leave out {flag} to use the Hub copy)")
        rows, source = _read_jsonl(file), str(file)
    if not rows:
        raise UserError(f"{source} holds no items; pass a non-empty HellaSwag jsonl")
    rows = rows[:limit] if limit is not None else rows
    return [check_item(row, f"{source} item {i}") for i, row in enumerate(rows)]
