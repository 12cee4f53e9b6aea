"""The card and curves on disk (`python -m publish.card`, and what the trainer writes into final/): which
panels the picture has, no image without matplotlib, final/ still a loadable model folder, an unfinished
run or a checkpoint exported with its card, and the same card in final/ as in a Hub export."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from common.errors import UserError
from model import GPT, GPTConfig
from publish.card import main as card_cli
from publish.card import write_card
from publish.card_content import plot_curves, write_model_card
from publish.hub import stage_export

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)


def _metrics(hellaswag: bool) -> list[dict]:
    rows = [{"step": s, "loss": 10.0 - 0.3 * s, "lr": 6e-4 * min(1, s / 3)} for s in range(1, 11)]
    rows[4]["val_loss"], rows[9]["val_loss"] = 9.0, 8.0
    if hellaswag:
        rows[9].update(hellaswag_acc=0.25, hellaswag_acc_norm=0.3)
    return rows


def _run(tmp_path: Path, *, finished: bool = True, hellaswag: bool = True) -> tuple[Path, GPT]:
    run = tmp_path / "my_run"
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"dataset": "shakespeare", "max_steps": 10}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _metrics(hellaswag)))
    checkpoint = run / "checkpoints" / "step_000010"
    checkpoint.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(checkpoint / "model.safetensors"))
    (checkpoint / "gpt_config.json").write_text(json.dumps(asdict(CONFIG)))
    if finished:
        model.save_pretrained(run / "final")
    return run, model


def test_curves_have_loss_hellaswag_when_measured_and_lr(tmp_path):
    assert plot_curves(_metrics(hellaswag=True), tmp_path / "a.png") == ["loss", "HellaSwag", "learning rate"]
    assert plot_curves(_metrics(hellaswag=False), tmp_path / "b.png") == ["loss", "learning rate"]
    assert (tmp_path / "a.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert plot_curves([{"step": 1, "lr": 1e-3}], tmp_path / "c.png") == []  # no loss: no picture
    assert not (tmp_path / "c.png").exists()


def test_cli_writes_card_and_curves_into_final_which_still_loads(tmp_path, capsys):
    """The card names the model, its usage, its context length, curves and results. Seen to catch (the context):
    the card template without its context sentence (issue 60)."""
    run, model = _run(tmp_path)
    assert card_cli(["--run_dir", str(run)]) == run / "final"
    card = (run / "final" / "README.md").read_text()
    assert card.startswith("---\n") and "# my_run" in card
    assert "Its context is 32 tokens: it reads at most that many at once" in card
    assert f'pipeline("text-generation", model="{(run / "final").as_posix()}")' in card
    assert "![Training curves: loss, HellaSwag, learning rate](loss_curve.png)" in card
    assert "| HellaSwag acc_norm | 0.3000 | 10 |" in card
    assert (run / "final" / "loss_curve.png").read_bytes().startswith(b"\x89PNG")
    tokens = torch.arange(17)[None]
    torch.testing.assert_close(GPT.from_pretrained(run / "final")(tokens[:, :-1], tokens[:, 1:])[1],
                               model(tokens[:, :-1], tokens[:, 1:])[1])
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(run / "final").n_layer == 2
    assert "written to" in capsys.readouterr().out


def test_without_matplotlib_the_card_has_no_image(tmp_path, monkeypatch):
    run, _ = _run(tmp_path)
    write_card(run)  # an earlier card with an image
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what a machine without it sees on import
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    write_card(run)
    assert not (run / "final" / "loss_curve.png").exists()  # no stale picture either
    card = (run / "final" / "README.md").read_text()
    assert "loss_curve.png" not in card and "| validation loss | 8.0000 | 10 |" in card


def test_unfinished_run_needs_an_output_and_gets_an_hf_export_there(tmp_path):
    run, model = _run(tmp_path, finished=False)
    with pytest.raises(UserError, match="has not finished .*pass --output DIR to export step_000010"):
        write_card(run)
    out = write_card(run, tmp_path / "export")
    card = (out / "README.md").read_text()
    assert "checkpoint step_000010 (the run had not finished)" in card
    assert f'model="{(tmp_path / "export").as_posix()}"' in card and ".tmp-" not in card
    assert GPT.from_pretrained(out).config.n_layer == 2 and not (run / "final").exists()
    again = write_card(run / "checkpoints" / "step_000010", out)  # a checkpoint by path; replaces the export
    assert again == out and (out / "loss_curve.png").is_file()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(UserError, match="exists and holds no model"):
        write_card(run, tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_run_dir_must_name_a_runs_weights(tmp_path):
    run, _ = _run(tmp_path, finished=False)
    (run / "checkpoints" / "step_000020").mkdir()  # a save that never finished
    with pytest.raises(UserError, match=r"step_000020 is not a complete checkpoint \(no gpt_config.json\); pick "):
        write_card(run / "checkpoints" / "step_000020", tmp_path / "export")
    GPT(CONFIG).save_pretrained(tmp_path / "hf")
    with pytest.raises(UserError, match=r"hf is a Hugging Face model folder, not a training run; pass the --out_dir"):
        write_card(tmp_path / "hf")
    assert write_card(run / "checkpoints" / "step_000010", tmp_path / "export") == tmp_path / "export"


def test_the_card_in_final_is_the_card_of_the_hub_export(tmp_path):
    run, _ = _run(tmp_path)
    write_card(run, hub_model_id="alice/tiny")  # what train.py writes with --push_to_hub
    export, what = stage_export(run)  # copies final/, card included
    before = {p.name: p.read_bytes() for p in export.iterdir()}
    write_model_card(run, export, "alice/tiny", source=what)  # what the push then rewrites
    assert {p.name: p.read_bytes() for p in export.iterdir()} == before
    assert before["README.md"] == (run / "final" / "README.md").read_bytes()


@pytest.mark.parametrize("block_size", [8, 16, 1024])
def test_the_cards_usage_example_runs_within_the_models_context(tmp_path, block_size):
    """The card's Python example, run as written against the exported folder (a short-context model used
    to fail: the prompt plus 40 new tokens did not fit).

    Seen to catch: the old fixed prompt + 40 new tokens."""
    import re

    folder = tmp_path / "model"
    GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=block_size)).save_pretrained(folder)
    card = write_model_card(tmp_path, folder, str(folder))
    code = re.search(r"```python\n(.*?)```", card.read_text(), re.S).group(1)
    exec(compile(code, "card-usage", "exec"), {})
