"""The one vocabulary check (`data.tokenizer.require_known_ids`) wherever tokens meet a model: training (weights and
data), eval.val_loss, eval.hellaswag, model.sample, and shards' largest id (recorded at prepare time, or read when an
older manifest has none). Each refusal is the function's own line, exit 2, and leaves nothing behind."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import run_in_process

import data.prepare as prep
from common.errors import UserError, run_cli
from data.settings import DataConfig
from data.source import open_source
from data.tokenizer import EOT_ID, get_tokenizer, require_known_ids

HELLASWAG = Path(__file__).parent / "fixtures" / "eval" / "hellaswag_tiny.jsonl"


def the_line(max_id: int, vocab_size: int, tokens: str, model: str) -> str:
    """The check's own message for these values: every site must print exactly it."""
    with pytest.raises(UserError) as refused:
        require_known_ids(max_id, vocab_size, tokens, model)
    return str(refused.value)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> Path:
    """A GPT-2-architecture HF folder whose vocabulary is 1,000 ids (transformers' own save, no tokenizer)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("vocab") / "v1000"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=64, n_embd=32, n_layer=1, n_head=2)) \
            .save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def foreign_shards(tmp_path_factory) -> Path:
    """A prepared shard folder whose manifest records an id past GPT-2's, as shards of another tokenizer would."""
    folder = tmp_path_factory.mktemp("vocab") / "shards"
    prep.prepare("shakespeare", folder, shard_tokens=100_000, val_tokens=2_000, max_tokens=20_000, progress=False)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["train"][0]["max_id"] = 60_000
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_the_check_passes_known_ids_and_names_both_sides():
    require_known_ids(999, 1000, "x", "y")
    assert the_line(50_256, 1000, "--dataset d", "--init_from m") == (
        "--dataset d has token id 50,256, but --init_from m knows only 1,000 token ids (0 to 999); they are GPT-2 "
        "tokens: use a model with GPT-2's vocabulary of 50,257 ids")
    assert the_line(60_000, 50_257, "--dataset d", "the model").endswith(
        "they are not GPT-2 tokens (ids 0 to 50,256): make them with `python -m data.prepare`")


def test_training_refuses_a_small_vocabulary_init_from_before_its_folder_exists(small_vocab, tmp_path, monkeypatch,
                                                                                  capsys):
    """Seen to catch: without the check in train.py, the run made its folder (config.yaml) and ended in a 39-line
    IndexError from the embedding at the first step."""
    out = tmp_path / "run"
    err = run_in_process(monkeypatch, capsys, ["--init_from", str(small_vocab), "--out_dir", str(out),
                                               "--max_steps", "2", "--block_size", "32"])
    assert err == "error: " + the_line(EOT_ID, 1000, "--dataset shakespeare", f"--init_from {small_vocab}")
    assert not out.exists()


def test_training_refuses_shards_holding_ids_past_the_model(foreign_shards, tmp_path, monkeypatch, capsys):
    """Seen to catch: with the shards' largest id not read (`TokenShards.max_token_id` returning the text sources'
    EOT), the run went on and trained (here only the manifest says 60,000; the bytes are GPT-2's, where shards of
    another tokenizer end in the embedding's IndexError)."""
    out = tmp_path / "run"
    err = run_in_process(monkeypatch, capsys, ["--dataset", str(foreign_shards), "--out_dir", str(out),
                                               "--max_steps", "2", "--n_layer", "1", "--n_head", "2", "--n_embd", "32",
                                               "--block_size", "32"])
    assert err == "error: " + the_line(60_000, 50_257, f"--dataset {foreign_shards}", "the model")
    assert not out.exists()


def test_an_older_manifest_without_largest_ids_is_read_from_its_shards(foreign_shards, tmp_path):
    """Seen to catch: `_largest_id` returning -1 for an entry without `max_id` (the check then passed shards holding
    id 60,000)."""
    folder = Path(shutil.copytree(foreign_shards, tmp_path / "old"))
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in [manifest["val"], *manifest["train"]]:
        del entry["max_id"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    source = open_source(DataConfig(dataset=str(folder)))
    assert source.max_token_id == int(max(np.fromfile(folder / e["file"], dtype="<u2").max()
                                          for e in [manifest["val"], *manifest["train"]]))
    with (folder / "train_000000.bin").open("r+b") as f:
        f.write(np.array([60_001], dtype="<u2").tobytes())
    with pytest.raises(UserError) as refused:
        source.check_vocab(50_257, "the model")
    assert str(refused.value) == the_line(60_001, 50_257, f"--dataset {folder}", "the model")


def test_prepare_records_each_shards_largest_id(tmp_path):
    """Seen to catch: ShardWriter keeping the largest id of its last write only (a shard is written batch by batch)."""
    parquet = Path(__file__).parent / "fixtures" / "data" / "fineweb_24docs.parquet"
    m = prep.prepare(str(parquet), tmp_path / "fw", shard_tokens=3000, val_tokens=1000, batch_docs=2, progress=False)
    for entry in [m["val"], *m["train"]]:
        assert entry["max_id"] == int(np.fromfile(tmp_path / "fw" / entry["file"], dtype="<u2").max())


def test_eval_val_loss_refuses_in_one_line(small_vocab, capsys):
    """Names the --dataset and the --model. Seen to catch: without `source.check_vocab` in main the line named "the
    validation set" and "the model" (evaluate_loss's own check); without both, the embedding's IndexError."""
    from eval.val_loss import main

    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: main(["--model", str(small_vocab), "--device", "cpu", "--max_tokens", "200"]))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err == "error: " + the_line(EOT_ID, 1000, "--dataset shakespeare", f"--model {small_vocab}") + "\n"


def test_evaluate_loss_checks_the_tokens_it_is_given(small_vocab):
    """The Python API checks the ids it scores. Seen to catch: `evaluate_loss` without its check (IndexError)."""
    from eval.val_loss import evaluate_loss
    from model import GPT

    model = GPT.from_pretrained(str(small_vocab))
    evaluate_loss(model, np.arange(65) % 1000, block_size=32, batch_size=2)  # ids it knows: scored
    tokens = np.arange(65) % 1000
    tokens[40] = 1000
    with pytest.raises(UserError) as refused:
        evaluate_loss(model, tokens, block_size=32, batch_size=2)
    assert str(refused.value) == the_line(1000, 1000, "the validation set", "the model")


def test_eval_hellaswag_refuses_in_one_line(small_vocab, capsys):
    """Seen to catch: eval.hellaswag without the check ended in the embedding's IndexError."""
    from eval.hellaswag import encode_items, load_items, main

    items = load_items(HELLASWAG)
    top = max(max(row) for e in encode_items(items, get_tokenizer(), 64) for row in e.rows)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: main(["--model", str(small_vocab), "--data", str(HELLASWAG), "--device", "cpu"]))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: " + the_line(top, 1000, "the HellaSwag text", "the model") + "\n"


def test_model_sample_says_the_same_line(small_vocab, capsys):
    """Sampling's refusal is the same check's line. Seen to catch: model.sample's own older wording."""
    from model.sample import main

    with pytest.raises(SystemExit):
        run_cli(lambda: main(["--model", str(small_vocab), "--prompt", "Hello"]))
    hello = get_tokenizer().encode("Hello")[0]
    assert capsys.readouterr().err == "error: " + the_line(hello, 1000, "the prompt", "the model") + "\n"
