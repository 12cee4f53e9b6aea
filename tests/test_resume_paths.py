"""Resume claims that the main resume tests leave open: kills at more moments (inside accelerate's
save_state, during checkpoint rotation, during the final export), and the shard and streaming data
sources driven through train.py (with two resumes in a row).

Each resumed run is compared with an uninterrupted run of the same arguments: bit for bit where the claim is
bit for bit.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import RESUME_ARGS, TINY, assert_same_weights, launch, read_metrics, resume_copy


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill_in_save_state:4", "kill_in_rotation:4", "kill_in_export"])
def test_kill_at_more_moments_then_resume_is_bit_exact(uninterrupted, tmp_path, fault):
    """RESUME_ARGS with rotation keeping one checkpoint, against the session's uninterrupted RESUME_ARGS run
    (conftest.py): --keep_last only decides which checkpoint folders are deleted, so the weights it ends with are
    those of the same arguments without it.

    Rotation also removes an older folder a crash left half-deleted (`[kill_in_rotation:4]`).

    Seen to catch: rotation deleting only complete (listed) checkpoints: `step_000002` left."""
    out = tmp_path / "run"
    args = RESUME_ARGS + ["--out_dir", str(out), "--keep_last", "1"]
    killed = launch(args, fault=fault, check=False)
    assert killed.returncode != 0 and not (out / "final").exists()
    if fault == "kill_in_save_state:4":
        assert not (out / "checkpoints" / "step_000004").exists()  # only its temp folder was written
    launch(args + ["--resume", "latest"])
    assert_same_weights(uninterrupted, out)
    assert [p.name for p in (out / "checkpoints").glob("step_*")] == ["step_000006"]  # rotation caught up
    assert not list(out.rglob(".tmp-*"))


# ---- data sources through train.py ----------------------------------------------------------------------

SOURCE_ARGS = TINY + ["--max_steps", "4", "--micro_batch_size", "2", "--total_batch_size", "64", "--save_every", "1",
                      "--eval_every", "4", "--dropout", "0.1"]


def _resumed_twice(reference: Path, out: Path, args: list[str], env: dict[str, str] | None = None) -> None:
    """A copy of the finished `reference` resumed from its checkpoint of step 2, then a copy of that resumed run
    resumed from its checkpoint of step 3, which the first resume wrote (conftest.resume_copy): the data position
    survives a resume and is saved again whole. Both end bit for bit as `reference` did."""
    once = out.parent / "resumed_once"
    launch(args + resume_copy(reference, 2, once), extra_env=env)
    launch(args + resume_copy(once, 3, out), extra_env=env)
    assert_same_weights(reference, once)


@pytest.mark.slow
def test_token_shards_through_train_py_resume_exactly(tmp_path):
    """Token shards and a streamed Hub dataset (`test_a_streamed_dataset_through_train_py_resumes_exactly_twice`) resume
    bit for bit through train.py, twice.

    Seen to catch: not broken on purpose (new tests); the loaders' own resume breaks are in test_data_streaming.py and
    test_data_shards.py."""
    from data.prepare import prepare

    shards = tmp_path / "shards"
    prepare(str(Path(__file__).parent / "fixtures" / "data" / "fineweb_24docs.parquet"), shards,
            shard_tokens=4_000, val_tokens=1_000)
    reference, out = tmp_path / "ref", tmp_path / "run"
    launch(SOURCE_ARGS + ["--dataset", str(shards), "--out_dir", str(reference)])
    _resumed_twice(reference, out, SOURCE_ARGS + ["--dataset", str(shards)])
    assert_same_weights(reference, out)
    assert [r["step"] for r in read_metrics(out)] == [r["step"] for r in read_metrics(reference)]


@pytest.mark.slow
def test_a_streamed_dataset_through_train_py_resumes_exactly_twice(tmp_path, monkeypatch):
    """The Hub streaming path (datasets' IterableDataset, resumed from its state_dict plus carried-over
    tokens), fed by local parquet files in place of a Hub id (tests/fake_streams.py); resumed twice, in process."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from fake_streams import stream_local_parquet

    # More documents than the stream holds out for validation (the first 1,000).
    lines = [line for line in (Path(__file__).parents[1] / "data" / "tinyshakespeare.txt").read_text().split("\n\n")
             if line.strip()]
    assert len(lines) > 1_300
    files = []
    for i in range(2):
        path = tmp_path / f"part{i}.parquet"
        pq.write_table(pa.table({"text": lines[i::2]}), path, row_group_size=100)
        files.append(str(path))
    stream_local_parquet(files, monkeypatch)
    args = SOURCE_ARGS + ["--dataset", "someone/a-streamed-corpus"]
    reference, out = tmp_path / "ref", tmp_path / "run"
    launch(args + ["--out_dir", str(reference)])
    _resumed_twice(reference, out, args)
    assert_same_weights(reference, out)
