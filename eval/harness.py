"""A bridge to EleutherAI's lm-evaluation-harness: any task it knows, on any model our CLIs accept.

    python -m eval.harness --model out/my_run --tasks hellaswag,arc_easy --output results.json
    python -m eval.harness --model gpt2 --tasks my_hellaswag --include_path my_tasks/ --output results.json

The harness's own numbers (its prompts, its `acc`/`acc_norm`), so they compare with published
tables. `--model` is a Hub id, an HF folder, one of our checkpoint folders or a run folder: our
runs and checkpoints are exported to a temporary HF folder (a finished run's `final/` is used as
it is) and loaded by the harness's `hf` model. `--include_path` adds a folder of task YAMLs, e.g. a
task that reads a local jsonl, which is how it runs offline. The results go to `--output` (the
harness's own result dict) and, when the model is one of our runs or checkpoints, as one line into
the run's `harness.jsonl` (see `record_in_run`). Needs `pip install lm-eval`, imported lazily.
Several GPUs: `accelerate launch -m eval.harness ...` (the harness splits the requests itself).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from checkpoint_io.weights import Kind, resolve_weights
from common.errors import UserError, run_cli
from common.network import reaching_the_hub
from common.run_dir import RunDir, checkpoint_step


def require_lm_eval() -> None:
    """Raise UserError unless lm-evaluation-harness imports (it is an optional dependency)."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:
        reason = " ".join(str(err).split())
        raise UserError(f"the lm-eval bridge needs lm-evaluation-harness, which cannot be imported ({reason}); "
                        "pip install lm-eval (or pip install -e \".[harness]\")") from err


@dataclass
class HarnessModel:
    """What the harness loads (`pretrained`: an HF folder, or a Hub id at `revision`) and, for our weights,
    where they came from."""

    pretrained: str
    run: RunDir | None = None  # the run whose harness.jsonl gets the results
    source: Path | None = None  # our folder: final/ or checkpoints/step_N inside `run`, or any HF folder or checkpoint
    revision: str | None = None  # of a Hub id
    tokenizer: str | None = None  # a folder of GPT-2 tokenizer files, for an HF folder saved without them

    @property
    def on_hub(self) -> bool:
        """Whether the harness downloads the model (a Hub id) rather than reads a folder."""
        return self.source is None and not Path(self.pretrained).exists()


@contextmanager
def resolve_model(spec: str, revision: str | None = None) -> Iterator[HarnessModel]:
    """`spec` as something the harness's `hf` model loads, for the duration of the block.

    A Hub id is passed on (lm-eval downloads it, tokenizer included) and an HF folder (our `final/`
    included) used as it is; our checkpoints, and runs that have not finished, are exported with
    `GPT.save_pretrained` to a temporary folder that is removed afterwards."""
    weights = resolve_weights(spec, revision, download=False)
    if weights.kind is Kind.HUB:
        yield HarnessModel(weights.spec, revision=weights.revision)
    elif weights.kind is Kind.HF_FOLDER:
        if any((weights.folder / name).is_file() for name in ("tokenizer.json", "vocab.json")):
            yield HarnessModel(str(weights.folder), weights.run, weights.folder)
            return
        # A plain `save_pretrained` of a model has no tokenizer files; GPT-2's, as eval.hellaswag uses them.
        from data.hf_tokenizer import save_tokenizer

        with tempfile.TemporaryDirectory(prefix="harness-tokenizer-") as tokenizer:
            save_tokenizer(tokenizer, model_max_length=json.loads((weights.folder / "config.json").read_text())
                           .get("n_positions", 1024))
            yield HarnessModel(str(weights.folder), weights.run, weights.folder, tokenizer=tokenizer)
    else:
        from model import GPT

        with tempfile.TemporaryDirectory(prefix="harness-export-") as tmp:
            GPT.from_pretrained(weights).save_pretrained(tmp)  # config, safetensors and the GPT-2 tokenizer files
            yield HarnessModel(tmp, weights.run, weights.folder)


def _local_tasks(include_path: str | None) -> Any:
    """The harness's TaskManager of `include_path`'s tasks alone (None without one): a second to build, where
    indexing the few thousand built-in task YAMLs takes several."""
    from lm_eval.tasks import TaskManager

    if include_path is None:
        return None
    if not Path(include_path).is_dir():
        raise UserError(f"--include_path {include_path} is not a folder; pass the folder holding the task YAMLs")
    return TaskManager(include_path=include_path, include_defaults=False)


def _task_manager(tasks: Sequence[str], include_path: str | None, local: Any) -> Any:
    """The harness's TaskManager; `local` (of `_local_tasks`) when `include_path` defines every task asked for."""
    from lm_eval.tasks import TaskManager

    if local is not None and all(task in local.all_tasks for task in tasks):
        return local
    return TaskManager(include_path=include_path)


def hub_needs(weights: HarnessModel, tasks: Sequence[str], local_tasks: Sequence[str]) -> list[str]:
    """What the harness fetches from the Hub, in words: a Hub model, and the datasets of the built-in tasks (those
    that `--include_path` does not define; its tasks read local files, which is what it is for). Our folders and
    HF folders never need it."""
    needs = [f"the model {weights.pretrained}"] if weights.on_hub else []
    if builtin := [task for task in tasks if task not in local_tasks]:
        needs.append(f"the dataset{'s' if len(builtin) > 1 else ''} of {', '.join(builtin)}")
    return needs


def refuse_an_unreachable_hub(weights: HarnessModel, needs: Sequence[str], instead: str) -> None:
    """One line at once, before the harness indexes its tasks and loads the model, when what `needs` the Hub cannot be
    had: the Hub out of reach (one request, no retries, where the harness's own downloads retry for minutes), or,
    in offline mode, a Hub model missing from the local cache. (Offline, a built-in task's dataset may be in the
    cache of `datasets`: the harness is left to look.)"""
    from huggingface_hub import constants, get_session, try_to_load_from_cache

    from common.network import hub_unreachable, offline_mode

    if not needs:
        return
    if offline_mode():
        if weights.on_hub and not isinstance(
                try_to_load_from_cache(weights.pretrained, "config.json", revision=weights.revision), str):
            raise hub_unreachable(ConnectionError("offline"), f"fetch the model {weights.pretrained}", instead)
        return
    with reaching_the_hub("fetch " + " and ".join(needs), instead):
        get_session().head(constants.ENDPOINT, timeout=10)


def _flat_metrics(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{task: {metric: value}}, with the harness's default filter suffix dropped ("acc,none" -> "acc")."""
    flat = {}
    for task, values in results.items():
        flat[task] = {key.removesuffix(",none"): value for key, value in values.items()
                      if "," in key and isinstance(value, (int, float))}
    return flat


def run_harness(
    weights: HarnessModel,
    tasks: Sequence[str],
    *,
    include_path: str | None = None,
    batch_size: int | str = 16,
    device: str | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    log_samples: bool = False,
) -> dict[str, Any] | None:
    """`lm_eval.simple_evaluate` on `weights`: the harness's result dict (on the main process; None on others)."""
    require_lm_eval()
    from lm_eval import simple_evaluate

    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    local = _local_tasks(include_path)
    # The harness downloads a Hub model itself, and the datasets of its built-in tasks.
    needs = hub_needs(weights, tasks, local.all_tasks if local is not None else ())
    instead = "pass a local --model folder and tasks that read local files (--include_path)"
    refuse_an_unreachable_hub(weights, needs, instead)
    task_manager = _task_manager(tasks, include_path, local)
    unknown = [task for task in tasks if task not in task_manager.all_tasks]
    if unknown:
        raise UserError(f"unknown lm-eval task(s) {', '.join(unknown)}; check the names with `lm_eval ls tasks`, "
                        "or pass --include_path with the folder of their YAML files")
    try:
        model_args = {"pretrained": weights.pretrained, **({"revision": weights.revision} if weights.revision else {}),
                      **({"tokenizer": weights.tokenizer} if weights.tokenizer else {})}
        # A local task's YAML may still name a Hub dataset: then its datasets are what the Hub was needed for.
        with reaching_the_hub("fetch " + " and ".join(needs or [f"the datasets of {', '.join(tasks)}"]), instead):
            return simple_evaluate(model="hf", model_args=model_args, tasks=list(tasks),
                                   task_manager=task_manager, batch_size=batch_size, device=device, limit=limit,
                                   num_fewshot=num_fewshot, log_samples=log_samples)
    except AssertionError as err:
        # The harness asserts (without a message) that every continuation fits in the model's context, where
        # eval.hellaswag cuts on the left and goes on; name the likely cause instead of a bare traceback.
        raise UserError(f"lm-eval stopped on an assertion ({err or 'no message'}), most often an answer longer than "
                        "the model's context; use a model with more positions, or eval.hellaswag for HellaSwag"
                        ) from err


def record_in_run(weights: HarnessModel, output: dict[str, Any]) -> Path | None:
    """Append the results as one JSON line to `<run>/harness.jsonl` when the model is one of our runs.

    A file of its own, not `metrics.jsonl`: those rows are training steps (a resume truncates them by
    step), and harness results can be added to a finished run at any later time. One line per call:
    `time`, `weights` (`final` or `checkpoints/step_N`), `step` (the checkpoint's; null for final/),
    `lm_eval_version`, `n_samples` and `results` ({task: {metric: value}})."""
    if weights.run is None or weights.source is None:
        return None
    row = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "weights": weights.source.relative_to(weights.run.path).as_posix(),
        "step": checkpoint_step(weights.source),
        "lm_eval_version": output.get("lm_eval_version"),
        "n_samples": {task: n.get("effective") for task, n in output.get("n-samples", {}).items()},
        "results": _flat_metrics(output["results"]),
    }
    with open(weights.run.harness_file, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    return weights.run.harness_file


def _table(output: dict[str, Any]) -> str:
    lines = [f"{'task':<24}{'metric':<20}{'value':>8}"]
    for task, values in _flat_metrics(output["results"]).items():
        lines += [f"{task:<24}{metric:<20}{value:>8.4f}" for metric, value in values.items()
                  if not metric.split(",")[0].endswith("_stderr")]
    return "\n".join(lines)


def _batch_size(text: str) -> int | str:
    if text == "auto" or text.startswith("auto:"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or auto")
    return value


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hub id, HF GPT-2 folder, our checkpoint folder or run folder")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names, e.g. hellaswag,arc_easy")
    parser.add_argument("--include_path", default=None,
                        help="a folder of extra task YAMLs (e.g. tasks reading local files, for offline use)")
    parser.add_argument("--output", default=None, help="write the harness's results as JSON here")
    parser.add_argument("--batch_size", type=_batch_size, default=16, help="requests per forward pass, or auto")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N documents of each task")
    parser.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    args = parser.parse_args(argv)
    tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    if not tasks:
        raise UserError("--tasks is empty; pass task names separated by commas, e.g. --tasks hellaswag")
    require_lm_eval()  # before an export that would be wasted

    with resolve_model(args.model) as weights:
        output = run_harness(weights, tasks, include_path=args.include_path, batch_size=args.batch_size,
                             device=args.device, limit=args.limit, num_fewshot=args.num_fewshot)
    if output is None:  # not the main process of a launch
        return None
    output["gpt2_accelerate"] = {"model": args.model, "weights": str(weights.source or weights.pretrained)}
    print(_table(output), flush=True)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(output, f, indent=2, default=str)  # the harness's config holds a few non-JSON objects
            f.write("\n")
    recorded = record_in_run(weights, output)
    if recorded:
        print(f"results added to {recorded}", flush=True)
    return output


if __name__ == "__main__":
    run_cli(main)
