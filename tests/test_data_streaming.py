"""The streaming (Hub) path, driven through local parquet: packing, ranks, val hold-out, resume."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import data.source as source_module
from common.errors import UserError
from data import EOT_ID, get_tokenizer
from data.hub import HubData
from data.settings import DataConfig
from data.source import DataSource, open_source
from data.streaming import StreamingLoader, open_hub_stream

PARQUET = Path(__file__).parent / "fixtures" / "data" / "fineweb_24docs.parquet"
DOCS = pq.read_table(PARQUET).column("text").to_pylist()
VAL_DOCS = 4


def source(dataset: str, **settings) -> DataSource:
    """`dataset` parsed as train.py parses `--dataset` (other settings at their defaults unless given)."""
    return open_source(DataConfig(dataset=dataset, **settings))


@pytest.fixture(scope="module")
def four_files(tmp_path_factory) -> list[str]:
    """The fixture split into 4 parquet files: split_dataset_by_node then assigns whole files."""
    folder = tmp_path_factory.mktemp("parts")
    table = pq.read_table(PARQUET)
    for i in range(4):
        pq.write_table(table.slice(6 * i, 6), folder / f"part{i}.parquet", row_group_size=3)
    return [str(p) for p in sorted(folder.glob("*.parquet"))]


def _loader(rank: int, world: int, files=str(PARQUET), batch: int = 4, block: int = 32,
            prefetch: int = 2) -> StreamingLoader:
    ds = open_hub_stream("parquet", None, "train", data_files=files)
    return StreamingLoader(ds, block_size=block, micro_batch_size=batch, rank=rank, world_size=world,
                           val_docs=VAL_DOCS, docs_per_batch=3, prefetch=prefetch)


def _rank_documents(loader: StreamingLoader, n_batches: int) -> list[str]:
    """Decode a rank's packed stream (rows overlap by one token) back into whole documents."""
    rows = [x for _ in range(n_batches) for x in loader.next_batch()[0].tolist()]
    stream = [t for row in rows for t in row]
    text = get_tokenizer().decode(stream)
    return text.split("<|endoftext|>")[:-1]  # the last piece may be cut mid-document


def test_single_rank_stream_is_the_packed_training_documents():
    x, y = _loader(0, 1).next_batch()
    assert x.shape == (4, 32) and (x[:, 1:] == y[:, :-1]).all() and (x[1:, 0] == y[:-1, -1]).all()
    enc = get_tokenizer()
    train = [t for d in DOCS[VAL_DOCS:] for t in enc.encode_ordinary(d) + [EOT_ID]]
    loader = _loader(0, 1, block=64)
    rows = [r for _ in range(50) for r in loader.next_batch()[0].tolist()]
    stream = [t for r in rows for t in r]
    assert stream == (train * 2)[: len(stream)]  # in order, no padding, and it repeats (epochs)
    assert len(stream) > len(train)


@pytest.mark.parametrize("layout", ["one-file", "four-files"])
def test_two_ranks_get_disjoint_documents_and_never_the_val_ones(layout, four_files):
    files = str(PARQUET) if layout == "one-file" else four_files
    seen = []
    for rank in range(2):
        docs = _rank_documents(_loader(rank, 2, files, block=64), 60)  # > one epoch of this rank's share
        seen.append(set(docs))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(DOCS[VAL_DOCS:])
    assert 5 <= len(seen[0]) <= 15 and 5 <= len(seen[1]) <= 15  # both ranks get a real share


def test_val_tokens_are_the_held_out_documents(monkeypatch):
    enc = get_tokenizer()
    import data.streaming as streaming

    monkeypatch.setattr(streaming, "VAL_DOCS", VAL_DOCS)  # read by val_documents, at call time
    monkeypatch.setattr(source_module, "open_hub_stream",
                        lambda *a, **k: open_hub_stream("parquet", None, "train", data_files=str(PARQUET)))
    monkeypatch.setattr(source_module, "locate_hub_dataset",
                        lambda name, config, revision: HubData(name, "0" * 40, config))
    val = source("some/hub-dataset", val_tokens=10**6).val_set(block_size=32)
    assert val.dtype == np.uint16
    assert val.tolist() == [t for d in DOCS[:VAL_DOCS] for t in enc.encode_ordinary(d) + [EOT_ID]]


@pytest.mark.parametrize("layout,skip", [("one-file", 0), ("one-file", 3), ("one-file", 25), ("four-files", 9)])
def test_resume_gives_identical_batches(layout, skip, four_files):
    files = str(PARQUET) if layout == "one-file" else four_files
    for rank in range(2):
        loader = _loader(rank, 2, files)
        for _ in range(skip):
            loader.next_batch()
        state = json.loads(json.dumps(loader.state_dict()))
        expected = [loader.next_batch()[0] for _ in range(30)]  # crosses document batches and epochs
        resumed = _loader(rank, 2, files)
        resumed.load_state_dict(state)
        for want in expected:
            assert (resumed.next_batch()[0] == want).all()


def test_resume_with_another_world_size_is_refused():
    state = _loader(0, 2).state_dict()
    with pytest.raises(UserError, match="saved with world size 2, now 4.*data.prepare"):
        _loader(0, 4).load_state_dict(state)
    with pytest.raises(UserError, match="rank 0"):
        _loader(1, 2).load_state_dict(state)


def test_missing_text_column_is_a_user_error():
    ds = open_hub_stream("parquet", None, "train", data_files=str(PARQUET))
    with pytest.raises(UserError, match="no column 'body'.*--text_column"):
        StreamingLoader(ds, block_size=8, micro_batch_size=1, rank=0, world_size=1, text_column="body")


def test_hub_dataset_while_offline_is_a_user_error():
    with pytest.raises(UserError, match="HuggingFaceFW/fineweb.*sample-10BT.*HF_DATASETS_OFFLINE.*data.prepare"):
        source("HuggingFaceFW/fineweb:sample-10BT").train_loader(block_size=8, micro_batch_size=1, rank=0, world_size=1,
                                                                 seed=0)
    with pytest.raises(UserError, match="HF_DATASETS_OFFLINE"):
        source("Skylion007/openwebtext", val_tokens=10).val_set(block_size=8)


def test_rank_with_only_validation_documents_raises_instead_of_spinning(tmp_path):
    """An endless stream whose every document is held out must not loop forever (a DDP hang)."""
    import pyarrow as pa

    path = tmp_path / "ten.parquet"
    pq.write_table(pa.table({"text": [f"document number {i}" for i in range(10)]}), path)
    ds = open_hub_stream("parquet", None, data_files=str(path))
    loader = StreamingLoader(ds, block_size=8, micro_batch_size=2, rank=0, world_size=1, val_docs=10)
    with pytest.raises(UserError, match="got no training documents"):
        loader.next_batch()


def _read_ahead_fully(loader: StreamingLoader) -> None:
    """Wait until the loader's thread has read as far ahead as it may (its queue full)."""
    import time

    deadline = time.monotonic() + 30
    while not loader._ahead._queue.full():
        assert time.monotonic() < deadline, "the stream was not read ahead"
        time.sleep(0.01)


@pytest.mark.parametrize("skip", [0, 1, 5, 13])
def test_documents_read_ahead_but_not_used_are_neither_skipped_nor_repeated_after_a_resume(skip):
    """The state is the position of what the step took: with two document batches read ahead (and not yet used)
    when it is saved, the resumed loader continues with exactly the rows of the uninterrupted one, which are the rows
    of a loader that reads nothing ahead.

    The earlier resume tests run with the read-ahead on too.

    Seen to catch: the state saved at the read-ahead position (`_read_anchor` instead of the taken batch's `_anchor`): 6
    of 8 resume cases fail."""
    inline = _loader(0, 1, prefetch=0)
    reference = [inline.next_batch()[0] for _ in range(skip + 30)]  # crosses document batches and epochs
    loader = _loader(0, 1)
    assert all((loader.next_batch()[0] == want).all() for want in reference[:skip])
    if skip:
        _read_ahead_fully(loader)  # 2 batches of 3 documents read ahead, not used
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    resumed = _loader(0, 1)
    resumed.load_state_dict(state)
    for want in reference[skip:]:
        assert (resumed.next_batch()[0] == want).all()
    resumed.close()
    assert not resumed._ahead and inline.state_dict() != state


def test_a_read_that_fails_ahead_is_raised_when_the_step_takes_that_batch(monkeypatch):
    """A read that fails in the background (its retries spent) is raised by the batch that needed it, after every
    batch read before it, and the loader's state is still that of the last batch taken.

    Seen to catch: not broken on purpose (a new test)."""
    import data.streaming as streaming

    loader = _loader(0, 1, block=64)
    reads = {"n": 0}
    read = loader._read_documents

    def third_read_fails():
        reads["n"] += 1
        if reads["n"] == 3:
            raise streaming.DataUnavailable("reading the dataset failed 6 times")
        return read()

    monkeypatch.setattr(loader, "_read_documents", third_read_fails)
    rows = []
    with pytest.raises(streaming.DataUnavailable):
        while True:
            rows.append(loader.next_batch()[0])
            state = loader.state_dict()
    inline = _loader(0, 1, block=64, prefetch=0)
    assert rows and all((inline.next_batch()[0] == r).all() for r in rows)  # both batches read before it, whole
    assert state["started"] and state["pos"] > 0
    loader.close()


@pytest.mark.parametrize("local_ranks,threads", [(None, 8), ("2", 4), ("8", 1), ("16", 1)])
def test_a_rank_encodes_on_its_share_of_the_nodes_cores(monkeypatch, local_ranks, threads):
    """8 cores: one process encodes on all 8, each of 2 ranks on 4, each of 8 or 16 ranks on 1 (never 0).

    In the read-ahead thread too.

    Seen to catch: not broken on purpose: a new test of the rule `_threads_per_rank` already had."""
    import data.streaming as streaming

    monkeypatch.setattr(streaming, "default_threads", lambda: 8)
    if local_ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    used = []
    encode = streaming.encode_documents
    monkeypatch.setattr(streaming, "encode_documents", lambda docs, n=None: used.append(n) or encode(docs, n))
    loader = _loader(0, 1)
    loader.next_batch()
    loader.close()
    assert used and set(used) == {threads}  # in the read-ahead thread too
