"""`--dataset` parsed once (data.source): each kind, each refusal, the first record read once, what a source says
about itself, and the validation-window rule (data.settings) that configs, training and eval.val_loss share."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import data.prepare as prep
import data.source as source_module
from common.errors import UserError
from data.hub import HubData
from data.settings import DataConfig, check_val_tokens, count_windows, require_a_window
from data.source import (
    HubStream,
    PromptCompletion,
    Shakespeare,
    TextFiles,
    TokenShards,
    open_source,
)
from data.strided import StridedLoader
from data.tokens import TokenStream

FIXTURES = Path(__file__).parent / "fixtures" / "data"
PARQUET = FIXTURES / "fineweb_24docs.parquet"


def source(dataset: str, **settings):
    return open_source(DataConfig(dataset=dataset, **settings))


def write_pairs(path: Path, n: int = 20) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"Q{i}:", "completion": f" answer {i}"}) + "\n" for i in range(n)))
    return path


@pytest.fixture
def shards(tmp_path) -> Path:
    out = tmp_path / "shards"
    prep.prepare("shakespeare", out, shard_tokens=5000, val_tokens=1000, max_tokens=10_000, progress=False)
    return out


# ---- one parse, one kind ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dataset", [str(FIXTURES / "docs.jsonl"), str(PARQUET), str(FIXTURES / "txt"),
                                     str(FIXTURES / "txt" / "*.txt"), str(FIXTURES / "txt" / "a.txt")])
def test_local_text_of_every_form(dataset):
    s = source(dataset, text_column="text")
    assert type(s) is TextFiles and s.path == dataset and s.text_column == "text" and not s.masked_targets


def test_each_other_kind(tmp_path, shards):
    """`--dataset` is parsed once into its kind (`data/source.py`): a shard folder before a local path,
    prompt/completion by the first record, `id:config` with `--dataset_config` winning (also
    `test_local_text_of_every_form`, `test_a_hub_source_streams_its_id_and_config`).

    Seen to catch: local paths tried before the manifest (a shard folder parsed as text); `config or dataset_config`;
    the stream opened without its config."""
    assert type(source("shakespeare")) is Shakespeare
    assert type(source(str(shards))) is TokenShards
    pairs = source(str(write_pairs(tmp_path / "p.jsonl")), prompt_field="prompt", completion_field="completion")
    assert type(pairs) is PromptCompletion and pairs.masked_targets
    hub = source("HuggingFaceFW/fineweb-edu:sample-10BT", text_column="body")
    assert (type(hub), hub.name, hub.config, hub.text_column) == (HubStream, "HuggingFaceFW/fineweb-edu", "sample-10BT",
                                                                  "body")
    owt = source("Skylion007/openwebtext")
    assert (owt.name, owt.config, owt.revision) == ("Skylion007/openwebtext", None, None)
    pinned = source("HuggingFaceFW/fineweb-edu:sample-10BT@refs/convert/parquet")
    assert (pinned.name, pinned.config, pinned.revision) == ("HuggingFaceFW/fineweb-edu", "sample-10BT",
                                                             "refs/convert/parquet")
    assert source("a/b@" + "f" * 40, dataset_config="y").revision == "f" * 40
    assert source("a/b:x", dataset_config="y").config == "y"  # an explicit --dataset_config wins
    assert source("a/b:", dataset_config=None).config is None


def test_the_loader_matches_the_kind(tmp_path, shards):
    geometry = dict(block_size=8, micro_batch_size=2, rank=0, world_size=1, seed=0)
    pairs = source(str(write_pairs(tmp_path / "p.jsonl")))
    assert pairs.train_loader(**geometry).masked_targets is pairs.masked_targets is True
    for text in (source("shakespeare"), source(str(FIXTURES / "docs.jsonl")), source(str(shards))):
        loader = text.train_loader(**geometry)
        assert type(loader) is StridedLoader and loader.masked_targets is text.masked_targets is False


def test_a_hub_source_streams_its_id_and_config(monkeypatch):
    from data.streaming import open_hub_stream

    asked = []

    def local_stream(name, config, split="train", data_files=None, revision=None):
        asked.append((name, config, split))
        return open_hub_stream("parquet", None, "train", data_files=str(PARQUET))

    monkeypatch.setattr(source_module, "open_hub_stream", local_stream)
    monkeypatch.setattr(source_module, "locate_hub_dataset", located)
    loader = source("someone/corpus:en").train_loader(block_size=8, micro_batch_size=1, rank=0, world_size=1, seed=0)
    assert asked == [("someone/corpus", "en", "train")] and loader.source == "someone/corpus:en"
    list(source("someone/corpus", dataset_config="de").document_batches("validation", 8))
    assert asked[-1] == ("someone/corpus", "de", "validation")


# ---- refusals: one line each -----------------------------------------------------------------------------

def test_an_empty_revision_is_refused_when_parsed():
    for dataset in ("a/b@", "a/b:c@", "@main"):
        with pytest.raises(UserError, match=r"^--dataset .*: write a Hub revision as id@revision") as err:
            source(dataset)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("dataset", ["my corpus", ":sample-10BT", "bad..name", "-x/y"])
def test_neither_a_path_nor_a_hub_id_is_refused_when_parsed(dataset):
    """A string that is neither a local path nor a Hub id is refused when parsed, in one line.

    Seen to catch: `validate_repo_id` not called: no error."""
    with pytest.raises(UserError) as err:
        source(dataset)
    assert str(err.value).startswith(f"--dataset {dataset!r} is neither an existing local path nor a Hub dataset id; ")
    assert "\n" not in str(err.value)


def test_prepare_refuses_what_is_not_text_before_writing_anything(tmp_path, shards):
    """`data.prepare` parses as training does, and refuses shards and prompt/completion data before writing anything.

    Seen to catch: the parse moved after the out folder is made: the folder is left behind."""
    pairs = write_pairs(tmp_path / "p.jsonl")
    for dataset, match in ((shards, "already holds token shards; train on it directly"),
                           (pairs, "holds prompt/completion records .* data.prepare packs text only")):
        with pytest.raises(UserError, match=match) as err:
            prep.prepare(str(dataset), tmp_path / "out", progress=False)
        assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="^--val_split applies to Hub datasets only"):
        prep.prepare(str(FIXTURES / "docs.jsonl"), tmp_path / "out", val_split="test", progress=False)


def test_a_missing_local_path_is_refused_when_parsed(tmp_path):
    """Refused by open_source itself, which train.py calls before it loads any weights (issue 60: `--init_from gpt2
    --dataset missing.txt` offline named the Hub first). Seen to catch: the refusal left to the first read."""
    with pytest.raises(UserError, match="dataset path '.*gone.txt' does not exist"):
        source(str(tmp_path / "gone.txt"))
    with pytest.raises(UserError, match="no .txt, .jsonl or .parquet files found"):
        source(str(tmp_path / "*.jsonl"))


@pytest.mark.parametrize("offline", [True, False])
def test_a_shard_folder_not_made_yet_names_data_prepare(monkeypatch, offline):
    """`dataset: shards/fineweb_edu_10B` (the FineWeb-Edu presets) before data.prepare made it: the local folder that
    is not there yet and the command that makes it, never a Hub id, online or offline. Seen to catch: the value read
    as a Hub dataset ("cannot stream Hub dataset shards/fineweb_edu_10B: offline ...; unset it", and online "cannot
    reach the Hugging Face Hub")."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(source_module, "locate_hub_dataset", lambda *a: pytest.fail("asked the Hub"))
    with pytest.raises(UserError) as err:
        source("shards/fineweb_edu_10B").describe()
    assert str(err.value) == (
        "--dataset shards/fineweb_edu_10B: no such folder yet; token shards are made once, with `python -m "
        "data.prepare --dataset <a Hub id or local files> --out shards/fineweb_edu_10B` (the FineWeb-Edu presets: "
        "--dataset HuggingFaceFW/fineweb-edu:sample-10BT), or pass a Hub id as --dataset to stream the data instead")
    assert isinstance(source("shards/fineweb_edu_10B@main"), HubStream)  # a Hub repo of a user named `shards`


# ---- prompt/completion detection reads the first record once ----------------------------------------------

def test_the_first_record_is_read_once(tmp_path, monkeypatch):
    """Prompt/completion detection reads the first record once: the parse, the train loader and the validation set open
    the file twice in all.

    Seen to catch: the train loader detecting again: 3 opens."""
    path = write_pairs(tmp_path / "once.jsonl")  # a new file: no cache of an earlier test holds it
    opened = []
    real_open = Path.open

    def counting_open(self, *args, **kwargs):
        if self.resolve() == path.resolve():
            opened.append(args[0] if args else kwargs.get("mode", "r"))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", counting_open)
    s = source(str(path))
    assert len(opened) == 1  # parsing: the first record, to tell prompt/completion data from text
    s.train_loader(block_size=16, micro_batch_size=2, rank=0, world_size=1, seed=0)
    s.val_set(block_size=16)
    s.describe()
    assert len(opened) == 2  # and the examples, read once for training and validation alike


# ---- what a source says about itself ---------------------------------------------------------------------

def located(name, config, revision):
    """`data.source.locate_hub_dataset` without a Hub: every id is found, at one commit."""
    return HubData(name, "c0ffee" + "0" * 34, config)


def test_describe(tmp_path, shards, monkeypatch):
    """The run header's data line; the card's data name and Hub id (`test_card_names_the_data`).

    Seen to catch: `1000` for `1,000` documents; Shakespeare without its Hub id."""
    monkeypatch.setattr(source_module, "locate_hub_dataset", located)
    pairs = write_pairs(tmp_path / "p.jsonl")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text('{"body": "text"}\n')
    monkeypatch.chdir(tmp_path)
    expected = {
        "shakespeare": "data: shakespeare (Tiny Shakespeare, shipped in data/) | validation: the last 10% of its "
                       "tokens, at most 8,192 tokens",
        "corpus/*.jsonl": "data: corpus/*.jsonl (local text files, tokenized in memory; column 'body' of "
                          ".jsonl/.parquet) | validation: the last 10% of its tokens, at most 8,192 tokens",
        str(pairs): f"data: {pairs} (prompt/completion examples, fields 'prompt' and 'completion'; the loss counts "
                    "completion tokens only) | validation: the last 10% of its examples, at most 8,192 tokens",
        str(shards): f"data: {shards} (token shards made by data.prepare) | validation: its val_000000.bin shard, at "
                     "most 8,192 tokens",
        "HuggingFaceFW/fineweb-edu:sample-10BT": "data: HuggingFaceFW/fineweb-edu:sample-10BT (Hub dataset "
            "HuggingFaceFW/fineweb-edu, config sample-10BT (commit c0ffee000000), column 'body', streamed) | "
            "validation: its first 1,000 documents, at most 8,192 tokens",
        "Skylion007/openwebtext": "data: Skylion007/openwebtext (Hub dataset Skylion007/openwebtext (commit "
                                  "c0ffee000000), column 'body', streamed) | validation: its first 1,000 "
                                  "documents, at most 8,192 tokens",
    }
    for dataset, line in expected.items():
        assert source(dataset, text_column="body").describe() == line
    assert source("shakespeare", val_tokens=100).describe().endswith("at most 100 tokens")


def test_card_names_the_data(tmp_path, monkeypatch):
    fw = "[HuggingFaceFW/fineweb-edu](https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu"
    assert source("HuggingFaceFW/fineweb-edu:sample-10BT").card_text() == fw + ") (config `sample-10BT`)"
    assert source("HuggingFaceFW/fineweb-edu:sample-10BT@v1.0.0").card_text() == \
        fw + "/tree/v1.0.0) (config `sample-10BT`, revision `v1.0.0`)"
    assert source("shakespeare").hub_id == "karpathy/tiny_shakespeare"
    for folder, file in (("data", "corpus.txt"), ("shards", "a.parquet")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / file).write_bytes(PARQUET.read_bytes() if file.endswith(".parquet") else b"text")
    monkeypatch.chdir(tmp_path)
    for local in ("data/corpus.txt", "shards/*.parquet", str(write_pairs(tmp_path / "p.jsonl"))):
        assert source(local).hub_id is None and source(local).card_text() == f"`{local}`"


def test_small_split_advice_of_each_kind(shards):
    assert source("shakespeare").val_advice(20, 32) == (
        "the validation split of shakespeare is the last 10% of its tokens; pass --block_size 19 or less, or add text "
        "to the corpus (about 330 tokens in all)")
    assert source("a/b").val_advice(1, 1024) == (
        "the validation split of a/b is its first 1,000 documents; pre-tokenize it with `python -m data.prepare "
        "--val_tokens N` and train on that folder")
    assert source(str(shards)).val_advice(5, 8).startswith(
        f"the validation split of {shards} is its val_000000.bin shard; pass --block_size 4 or less, or prepare")


# ---- the validation-window rule --------------------------------------------------------------------------

def test_windows_of_block_size_plus_one_tokens_sharing_one():
    """One validation-window rule (`data/settings.py`): windows of block_size + 1 tokens sharing one, the training
    loader's cut. A set of block_size tokens is refused, block_size + 1 accepted
    (`test_a_set_shorter_than_one_window_is_refused_and_one_window_is_not`); the split is refused with its source's
    advice (`test_val_set_refuses_a_short_split_with_the_sources_advice`).

    Seen to catch: `n // block_size` windows; `n < block_size` refused; the generic advice in `val_set`."""
    assert [count_windows(n, 4) for n in (0, 1, 4, 5, 8, 9, 13)] == [0, 0, 0, 1, 1, 2, 3]
    # The same cut as the training loader's sequences.
    assert StridedLoader(TokenStream([np.zeros(13, np.uint16)]), block_size=4, micro_batch_size=1, rank=0,
                         world_size=1).n_sequences == count_windows(13, 4)


def test_a_set_shorter_than_one_window_is_refused_and_one_window_is_not():
    require_a_window(33, 32, "fix")
    with pytest.raises(UserError, match=r"^the validation set has 32 tokens, fewer than one window of block_size \+ 1 "
                                        r"= 33; fix$"):
        require_a_window(32, 32, "fix")
    check_val_tokens(33, 32)
    with pytest.raises(UserError, match=r"^--max_tokens 32 is less than one validation window \(block_size \+ 1 = "
                                        r"33\); pass --max_tokens 33 or more$"):
        check_val_tokens(32, 32, flag="--max_tokens")


def test_val_set_refuses_a_short_split_with_the_sources_advice(tmp_path):
    corpus = tmp_path / "small.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    small = source(str(corpus))
    n_val = len(small.split()[1])
    assert len(small.val_set(block_size=n_val - 1)) == n_val  # exactly one window
    with pytest.raises(UserError) as err:
        small.val_set(block_size=n_val)
    assert str(err.value) == (f"the validation set has {n_val} tokens, fewer than one window of block_size + 1 = "
                              f"{n_val + 1}; " + small.val_advice(n_val, n_val))
