"""The model card (README.md) and curves image (loss_curve.png) that go with a run's HF weights: in its
`final/` (written at the end of training, or by `python -m publish.card`) and in every Hub push.

Everything here is read from the run folder the trainer wrote: `config.yaml` (the training config),
`metrics.jsonl` (one JSON object per logged step) and the export's own `config.json` /
`model.safetensors`. No secret ever reaches the card: config keys that look like credentials are
masked, and the card is scrubbed of the current Hub token as a last line of defence.

The card's text is `card_template.md`, a Jinja template that huggingface_hub's `ModelCard.from_template`
fills with the metadata block and the values `render_card` computes here.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

import yaml

from checkpoint_io.weights import GPT2_NAMES
from common.errors import UserError
from common.hub_ids import is_repo_id, split_revision
from common.run_dir import RunDir
from configs import read_run_config
from data.settings import DataConfig
from data.source import DataSource, open_source
from data.tokenizer import get_tokenizer
from training.evaluations.registry import EVALUATIONS
from training.metrics import read_metrics

LOSS_CURVE = "loss_curve.png"
CARD_TEMPLATE = Path(__file__).with_name("card_template.md")  # the card's text, a Jinja template
LICENSE = "mit"  # the project's (pyproject.toml); the weights a run trains are offered under it
_SECRET_KEY = re.compile(r"(^|_)token$|secret|password|passwd|api_?key|credential", re.IGNORECASE)
# Short names the model package accepts, and the Hub repos they stand for.
_KNOWN_MODELS = {name: f"openai-community/{name}" for name in GPT2_NAMES}


def _results() -> dict[str, str]:
    """The card's results, by metrics.jsonl key: the run's own, then each evaluation's (`training.evaluations`)."""
    return {"tokens": "tokens seen", "loss": "train loss",
            **{m.key: m.label for spec in EVALUATIONS.values() for m in spec.metrics}}


def _notes(summary: dict[str, Any]) -> list[str]:
    """How each evaluation the run logged is scored, in the card's words (`EvaluationSpec.card_note`)."""
    return [spec.card_note for spec in EVALUATIONS.values()
            if spec.card_note and any(m.key in summary for m in spec.metrics)]


def summarize(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers a card reports: the last value of each metric and the step it was logged at."""
    summary: dict[str, Any] = {}
    for row in metrics:
        for key in _results():
            if isinstance(row.get(key), (int, float)):
                summary[key] = row[key]
                summary[f"{key}_step"] = row["step"]
    if metrics:
        summary["step"] = metrics[-1]["step"]
    return summary


def _series(metrics: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in metrics if isinstance(r.get(key), (int, float))]


def plot_curves(metrics: list[dict[str, Any]], path: Path) -> list[str]:
    """Render the run's curves against step as one PNG: train/val loss, HellaSwag when it was measured, the
    learning rate. Returns the titles of the panels drawn; empty (and no file) when there is nothing to plot
    or no matplotlib."""
    panels = {"loss": ("cross-entropy (nats/token)", [("train loss", _series(metrics, "loss"), "-")])}
    for metric in (m for spec in EVALUATIONS.values() for m in spec.metrics):  # each evaluation's, in its panel
        panels.setdefault(metric.panel, (metric.unit, []))[1].append((metric.line, _series(metrics, metric.key), "o-"))
    panels["learning rate"] = ("learning rate", [("lr", _series(metrics, "lr"), "-")])
    panels = [(title, ylabel, lines) for title, (ylabel, lines) in panels.items()]
    panels = [(title, ylabel, [line for line in lines if line[1]]) for title, ylabel, lines in panels]
    panels = [panel for panel in panels if panel[2]]
    # Without any loss the picture says nothing about the run: no image, as without matplotlib.
    if not panels or panels[0][0] != "loss":
        return []
    try:  # optional: the card simply has no image without it
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return []
    # The object API with an explicit Agg canvas: no pyplot, no global backend, no display needed.
    fig = Figure(figsize=(7, 1 + 2.6 * len(panels)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, ylabel, lines) in zip(axes, panels):
        for label, points, style in lines:
            ax.plot(*zip(*points), style, label=label, linewidth=1, markersize=3)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend()
    axes[-1].set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return [title for title, _, _ in panels]


def redact(value: Any) -> Any:
    """A copy of a config with string values under credential-like keys masked."""
    if isinstance(value, dict):
        return {k: "***" if _SECRET_KEY.search(str(k)) and isinstance(v, str) else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def recorded_source(config: dict[str, Any]) -> DataSource | None:
    """The data source a run's config records, parsed as training parsed it; None when it records no dataset or
    one that does not parse (a hand-edited config), which the card then names as written."""
    dataset = config.get("dataset")
    if not isinstance(dataset, str):
        return None
    try:
        return open_source(DataConfig(dataset=dataset, dataset_config=config.get("dataset_config")))
    except UserError:
        return None


def _base_model(config: dict[str, Any]) -> tuple[str | None, str | None]:
    """The Hub repo the run started from and its revision (a commit, as config.yaml records it), or Nones."""
    init = config.get("init_from")
    if not isinstance(init, str) or Path(init).exists():
        return None, None
    try:
        name, revision = split_revision(init, "init_from")
    except UserError:
        return None, None
    name = _KNOWN_MODELS.get(name, name)
    return (name, revision) if "/" in name and is_repo_id(name) else (None, None)


def _architecture(export_dir: Path) -> dict[str, Any]:
    """Sizes from the export's config.json and the parameter count from the safetensors header."""
    arch: dict[str, Any] = {}
    config_path = export_dir / "config.json"
    if config_path.is_file():
        hf = json.loads(config_path.read_text())
        arch = {k: hf.get(k) for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")}
    weights = export_dir / "model.safetensors"
    if weights.is_file():
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as f:
            total = 0
            for key in f.keys():
                n = 1
                for dim in f.get_slice(key).get_shape():
                    n *= dim
                total += n
        arch["params"] = total
    return arch


def _fmt(value: Any, digits: int = 4) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else "n/a"


def usage_prompt(n_positions: int | None) -> tuple[str, int]:
    """The usage example's prompt and number of new tokens, within the model's context (a model with a short
    context would fail on GPT-2's usual 'Hello, I am a language model,' + 40 tokens)."""
    prompt = "Hello, I am a language model,"
    room = (n_positions or 1024) - len(get_tokenizer().encode(prompt))
    if room < 1:
        prompt, room = "\n", (n_positions or 2) - 1
    return prompt, min(40, room)


def render_card(
    model_id: str,
    config: dict[str, Any],
    summary: dict[str, Any],
    arch: dict[str, Any],
    *,
    source: str,
    revision: str | None = None,
    curves: Sequence[str] = (),
    state_step: str | None = None,
    name: str | None = None,
) -> str:
    """README.md text: YAML metadata block, then usage, results, curves and training config.

    `model_id`: what `pipeline(model=...)` loads, the Hub repo id or, for a card kept on disk, the folder's
    path; `name` the title (default: the repo name). `curves`: the panels of loss_curve.png, if drawn."""
    from huggingface_hub import ModelCard, ModelCardData

    dataset, data_source = config.get("dataset"), recorded_source(config)
    base, base_revision = _base_model(config)
    data = ModelCardData(
        license=LICENSE,
        datasets=[data_source.hub_id] if data_source and data_source.hub_id else None,
        base_model=base,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["gpt2", "causal-lm", "gpt2-accelerate", "accelerate"],
    )
    at = f" at revision `{base_revision}`" if base_revision else ""
    tree = f"/tree/{base_revision}" if base_revision else ""
    prompt, new_tokens = usage_prompt(arch.get("n_positions"))
    card = ModelCard.from_template(
        data, template_path=str(CARD_TEMPLATE),
        name=name or model_id.split("/")[-1],
        size=f"{arch['params'] / 1e6:.1f}M-parameter " if arch.get("params") else "",
        shape=", ".join(f"{k}={arch[k]}" for k in ("n_layer", "n_head", "n_embd", "n_positions") if arch.get(k)),
        context=f"{arch['n_positions']:,}" if arch.get("n_positions") else None,
        how=f"fine-tuned from [{base}](https://huggingface.co/{base}{tree}){at}" if base else "trained from scratch",
        trained_on=data_source.card_text() if data_source else f"`{dataset}`" if dataset else "its training data",
        source=source, model_id=model_id, prompt=repr(prompt), new_tokens=new_tokens,
        revision_arg=f', revision="{revision}"' if revision else "",
        revision_kwarg=f", revision={revision!r}" if revision else "",
        # metrics the run never logged are left out
        results=[(label, _fmt(summary[key]), _fmt(summary[key + "_step"])) for key, label in _results().items()
                 if key in summary],
        notes=_notes(summary),
        curves=", ".join(curves), curve_file=LOSS_CURVE, state_step=state_step,
        config=yaml.safe_dump(redact(config), sort_keys=False).strip() if config else "",
    )
    return str(card).rstrip("\n") + "\n"


def write_model_card(
    run_dir: str | Path,
    export_dir: str | Path,
    hub_model_id: str | None,
    *,
    source: str = "the final weights of the run",
    revision: str | None = None,
    state_step: str | None = None,
    local_path: Path | None = None,
) -> Path:
    """Write README.md (and loss_curve.png when there are losses) into `export_dir`; returns the card's path.

    The same files for the Hub export and for a run's own `final/`: without a `hub_model_id` the card is
    named after the run folder and its usage example loads `local_path` (default: `export_dir`) from disk."""
    from huggingface_hub import get_token

    run, export_dir = RunDir(run_dir), Path(export_dir)
    metrics = read_metrics(run.metrics_file)
    curve = export_dir / LOSS_CURVE
    curves = plot_curves(metrics, curve)
    if not curves:
        curve.unlink(missing_ok=True)  # never leave a stale image from an earlier card
    if hub_model_id:
        model_id, name = hub_model_id, None
    else:
        model_id, name = (local_path or export_dir).as_posix(), run.path.resolve().name
    text = render_card(model_id, read_run_config(run.config_file), summarize(metrics), _architecture(export_dir),
                       source=source, revision=revision, curves=curves, state_step=state_step, name=name)
    token = get_token()
    if token:
        text = text.replace(token, "***")
    card = export_dir / "README.md"
    card.write_text(text, encoding="utf-8")
    return card
