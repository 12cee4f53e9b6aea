"""Tokenization/packing, the strided loader (ranks, world-size invariance, resume), local sources."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.errors import UserError
from data import EOT_ID, get_tokenizer
from data.settings import DataConfig
from data.source import DataSource, open_source
from data.strided import StridedLoader, permute_index
from data.tokens import TokenStream, encode_documents

FIXTURES = Path(__file__).parent / "fixtures" / "data"
SHAKESPEARE = Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare.txt"


def source(dataset: str, **settings) -> DataSource:
    """`dataset` parsed as train.py parses `--dataset` (other settings at their defaults unless given)."""
    return open_source(DataConfig(dataset=dataset, **settings))


def test_packing_round_trip_and_literal_eot():
    docs = [json.loads(line)["text"] for line in (FIXTURES / "docs.jsonl").read_text().splitlines()]
    packed = encode_documents(docs, num_threads=2)
    assert packed.dtype == np.uint16
    enc = get_tokenizer()
    assert enc.decode(packed.tolist()) == "<|endoftext|>".join(docs) + "<|endoftext|>"
    # One EOT id per document: the literal "<|endoftext|>" inside document 3 is encoded as text.
    assert int((packed == EOT_ID).sum()) == len(docs)
    expected = np.concatenate([np.array(enc.encode_ordinary(d) + [EOT_ID]) for d in docs])
    np.testing.assert_array_equal(packed, expected)


def test_token_stream_reads_across_arrays():
    parts = [np.arange(0, 5), np.arange(5, 7), np.arange(7, 20)]
    stream = TokenStream([p.astype(np.uint16) for p in parts])
    assert len(stream) == 20
    for start, length in [(0, 20), (3, 5), (4, 4), (6, 10), (19, 1)]:
        np.testing.assert_array_equal(stream.read(start, length), np.arange(start, start + length))
    with pytest.raises(IndexError):
        stream.read(15, 6)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 1000, 4099])
def test_permute_index_is_a_bijection(n):
    for key in (0, 12345):
        assert sorted(permute_index(i, n, key) for i in range(n)) == list(range(n))
    if n >= 100:  # and actually shuffles
        assert [permute_index(i, n, 1) for i in range(n)] != list(range(n))


def _stream(n_tokens: int) -> TokenStream:
    return TokenStream([np.arange(n_tokens, dtype=np.uint16)])


def _loader(stream, world, rank, batch, **kw) -> StridedLoader:
    return StridedLoader(stream, block_size=8, micro_batch_size=batch, rank=rank, world_size=world, **kw)


def test_sequences_overlap_by_one_token_and_y_is_shifted():
    """Targets are the inputs shifted by one token.

    Seen to catch: targets equal to the inputs."""
    tokens = _stream(8 * 10 + 1)
    loader = _loader(tokens, 1, 0, 3, shuffle=False)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (3, 8) and str(x.dtype) == "torch.int64"
    np.testing.assert_array_equal(x.numpy(), [np.arange(j * 8, j * 8 + 8) for j in range(3)])
    np.testing.assert_array_equal(y.numpy(), [np.arange(j * 8 + 1, j * 8 + 9) for j in range(3)])


def _global_steps(stream, world, batch, accum, steps, **kw):
    """Per optimizer step: the rows of all ranks and micro-steps, as a sorted list of tuples."""
    loaders = [_loader(stream, world, r, batch, **kw) for r in range(world)]
    out = []
    for _ in range(steps):
        rows = [tuple(row) for _ in range(accum) for ld in loaders for row in ld.next_batch()[0].tolist()]
        out.append(sorted(rows))
    return out


@pytest.mark.parametrize("shuffle", [False, True])
def test_world_size_invariance_of_global_batches(shuffle):
    """The same global batches for any number of processes (docs/data.md).

    Seen to catch: every rank reading the first rows of each global batch (`first = self.cursor`)."""
    stream = _stream(8 * 37 + 1)  # 37 sequences: steps of 4 wrap into the next epoch mid-window
    reference = _global_steps(stream, 1, 4, 1, 25, shuffle=shuffle, seed=3)
    assert _global_steps(stream, 2, 2, 1, 25, shuffle=shuffle, seed=3) == reference
    assert _global_steps(stream, 4, 1, 1, 25, shuffle=shuffle, seed=3) == reference
    assert _global_steps(stream, 2, 1, 2, 25, shuffle=shuffle, seed=3) == reference  # accumulation


def test_ranks_disjoint_equal_counts_and_epochs_cover_everything():
    n_seq = 40
    stream = _stream(8 * n_seq + 1)
    loaders = [_loader(stream, 2, r, 4, seed=1) for r in range(2)]
    seen = [[], []]
    for _ in range(n_seq // 8):  # exactly one epoch: 8 sequences per call over both ranks
        for r, ld in enumerate(loaders):
            seen[r] += [row[0] // 8 for row in ld.next_batch()[0].tolist()]
    assert len(seen[0]) == len(seen[1]) == n_seq // 2
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(n_seq))
    assert seen[0] + seen[1] != sorted(seen[0] + seen[1])  # shuffled
    # The next epoch is again a full pass, in another order; nobody runs dry.
    nxt = [row[0] // 8 for _ in range(n_seq // 8) for ld in loaders for row in ld.next_batch()[0].tolist()]
    assert sorted(nxt) == list(range(n_seq)) and loaders[0].state_dict()["cursor"] == 2 * n_seq


@pytest.mark.parametrize("new_world,new_batch", [(2, 3), (1, 6), (3, 2)])
def test_resume_gives_the_same_global_batches(new_world, new_batch):
    stream = _stream(8 * 29 + 1)
    loaders = [_loader(stream, 2, r, 3) for r in range(2)]
    for _ in range(7):
        for ld in loaders:
            ld.next_batch()
    states = [json.loads(json.dumps(ld.state_dict())) for ld in loaders]
    assert states[0]["cursor"] == states[1]["cursor"] == 42
    expected = sorted(tuple(row) for _ in range(5) for ld in loaders for row in ld.next_batch()[0].tolist())
    resumed = [_loader(stream, new_world, r, new_batch) for r in range(new_world)]
    for r, ld in enumerate(resumed):
        ld.load_state_dict(states[r % 2])
    got = sorted(tuple(row) for _ in range(5) for ld in resumed for row in ld.next_batch()[0].tolist())
    assert got == expected


def test_resume_rejects_a_different_block_size_or_seed():
    state = _loader(_stream(200), 1, 0, 2).state_dict()
    with pytest.raises(UserError, match="block_size"):
        StridedLoader(_stream(200), block_size=4, micro_batch_size=2, rank=0, world_size=1).load_state_dict(state)
    with pytest.raises(UserError, match="seed"):
        _loader(_stream(200), 1, 0, 2, seed=9).load_state_dict(state)


def test_shakespeare_split_matches_an_independent_encoding():
    enc = get_tokenizer()
    tokens = enc.encode_ordinary(SHAKESPEARE.read_text(encoding="utf-8")) + [EOT_ID]
    cut = int(len(tokens) * 0.9)
    val = source("shakespeare", val_tokens=10**9).val_set(block_size=64)
    assert val.dtype == np.uint16 and val.tolist() == tokens[cut:]
    assert source("shakespeare", val_tokens=100).val_set(block_size=64).tolist() == tokens[cut : cut + 100]
    loader = source("shakespeare").train_loader(block_size=64, micro_batch_size=2, rank=0, world_size=1, seed=0)
    assert len(loader.stream) == cut
    # Every training row is a slice of the first 90% at a multiple of the block size.
    x, y = loader.next_batch()
    train = np.array(tokens[:cut])
    for row_x, row_y in zip(x.numpy(), y.numpy()):
        windows = np.lib.stride_tricks.sliding_window_view(train, 64)[::64]
        start = int(np.flatnonzero(np.all(windows == row_x, axis=1))[0]) * 64
        np.testing.assert_array_equal(row_y, train[start + 1 : start + 65])


@pytest.mark.parametrize("name", ["docs.jsonl", "fineweb_24docs.parquet", "txt", "txt/*.txt"])
def test_local_sources_tokenize_their_documents(name):
    if name == "docs.jsonl":
        docs = [json.loads(line)["text"] for line in (FIXTURES / name).read_text().splitlines()]
    elif name.endswith(".parquet"):
        docs = pq.read_table(FIXTURES / name).column("text").to_pylist()
    else:
        docs = [p.read_text() for p in sorted((FIXTURES / "txt").glob("*.txt"))]
    enc = get_tokenizer()
    tokens = [t for d in docs for t in enc.encode_ordinary(d) + [EOT_ID]]
    cut = int(len(tokens) * 0.9)
    assert source(str(FIXTURES / name), val_tokens=10**9).val_set(block_size=4).tolist() == tokens[cut:]
    loader = source(str(FIXTURES / name)).train_loader(block_size=4, micro_batch_size=2, rank=1, world_size=2, seed=0)
    assert loader.stream.read(0, len(loader.stream)).tolist() == tokens[:cut]


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "setup,column,match",
    [
        (lambda d: str(d / "missing.txt"), "text", "does not exist"),
        (lambda d: _write(d / "empty.txt", ""), "text", "no text"),
        (lambda d: _write(d / "x.jsonl", '{"body": "hi"}\n'), "text", "--text_column"),
        (lambda d: str(FIXTURES / "fineweb_24docs.parquet"), "body", "--text_column"),
        (lambda d: _write(d / "a.csv", "x") and str(d), "text", "no .txt, .jsonl or .parquet"),
    ],
    ids=["missing", "empty", "jsonl-column", "parquet-column", "no-data-files"],
)
def test_bad_local_inputs_are_user_errors(tmp_path, setup, column, match):
    with pytest.raises(UserError, match=match):
        source(setup(tmp_path), text_column=column).train_loader(block_size=8, micro_batch_size=1, rank=0, world_size=1,
                                                                 seed=0)


def test_corpus_smaller_than_a_block_is_a_user_error(tmp_path):
    (tmp_path / "tiny.txt").write_text("Too short.")
    with pytest.raises(UserError, match="smaller --block_size"):
        source(str(tmp_path / "tiny.txt")).train_loader(block_size=64, micro_batch_size=1, rank=0, world_size=1, seed=0)


# ---- damaged or mistaken input files ---------------------------------------------------------------------

def test_non_utf8_jsonl_names_the_line_and_byte(tmp_path):
    path = tmp_path / "latin1.jsonl"
    first = b'{"text": "fine"}\n'
    path.write_bytes(first + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(UserError) as err:
        source(str(path), val_tokens=10).val_set(block_size=1)
    offset = len(first) + len(b'{"text": "caf')
    assert str(err.value) == (f"{path}:2 is not UTF-8 (byte {offset} of the file); re-save the file as UTF-8 or "
                              "remove that line")


def test_a_binary_txt_file_warns_and_training_goes_on(tmp_path, capsys):
    path = tmp_path / "noise.txt"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8).tobytes())
    loader = source(str(path)).train_loader(block_size=8, micro_batch_size=2, rank=0, world_size=1, seed=0)
    assert loader.next_batch()[0].shape == (2, 8)
    warning = capsys.readouterr().err.strip()
    assert warning.startswith(f"warning: {path}: ") and "invalid UTF-8 or NUL bytes" in warning
    assert "training goes on" in warning and len(warning.splitlines()) == 1


def test_text_with_a_few_non_utf8_bytes_is_silent(tmp_path, capsys):
    path = tmp_path / "mostly_fine.txt"
    path.write_bytes(b"plain text " * 100 + b"\xff")  # 1 bad byte in 1,101: under 1%
    source(str(path)).train_loader(block_size=8, micro_batch_size=2, rank=0, world_size=1, seed=0)
    assert capsys.readouterr().err == ""


def test_a_parquet_file_that_is_not_parquet(tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_text('{"text": "this is json, not parquet"}\n')
    with pytest.raises(UserError) as err:
        source(str(path)).train_loader(block_size=8, micro_batch_size=1, rank=0, world_size=1, seed=0)
    assert str(err.value).startswith(f"cannot read parquet file {path} (") and "\n" not in str(err.value)
    assert str(err.value).endswith("check that it is a complete parquet file")


def test_a_parquet_file_damaged_inside_its_row_groups(tmp_path):
    path = tmp_path / "damaged.parquet"
    pq.write_table(pa.table({"text": [f"document {i} " * 20 for i in range(2000)]}), path, compression="snappy")
    data = bytearray(path.read_bytes())
    data[100:5000] = b"\xab" * 4900  # the footer still reads; the first data pages do not
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"^cannot read parquet file .*damaged\.parquet \(.*\); check that it is"):
        source(str(path)).train_loader(block_size=8, micro_batch_size=1, rank=0, world_size=1, seed=0)
