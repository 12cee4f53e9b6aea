"""Preflight checks of the run folder: writable (one-line error otherwise) and enough free disk (a warning).

We run as root here, and root ignores permission bits, so a chmod'ed folder cannot show a refused write
on these machines. The refusal is exercised three ways: a file standing where a parent folder should be,
/proc (where the kernel refuses new files even for root), and tempfile.mkstemp replaced by one that fails
with EROFS/EACCES as a read-only mount would; the chmod test runs only for a non-root user.
"""
from __future__ import annotations

import errno
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from common.errors import UserError
from training.checkpoints import preflight
from training.checkpoints.preflight import (
    check_out_dir_writable,
    checkpoint_bytes,
    nearest_existing,
    saves_ahead,
    warn_if_low_disk,
)


def test_writable_folder_passes_and_is_left_as_it_was(tmp_path: Path):
    (tmp_path / "kept.txt").write_text("x")
    check_out_dir_writable(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]


def test_a_missing_out_dir_is_checked_at_its_nearest_parent_and_not_created(tmp_path: Path):
    out = tmp_path / "a" / "b" / "run"
    assert nearest_existing(out) == tmp_path
    check_out_dir_writable(out)
    assert list(tmp_path.iterdir()) == []


def test_a_file_on_the_path_is_a_user_error(tmp_path: Path):
    (tmp_path / "blocker").write_text("x")
    with pytest.raises(UserError, match=r"blocker is a file, so the run folder cannot be created there"):
        check_out_dir_writable(tmp_path / "blocker" / "run")


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_a_refused_write_names_the_folder(tmp_path: Path, monkeypatch, code):
    def refuse(**kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(UserError) as err:
        check_out_dir_writable(tmp_path / "run")
    assert str(err.value) == (f"--out_dir {tmp_path / 'run'}: cannot write to {tmp_path} ({os.strerror(code)}); "
                              "make it writable or choose another --out_dir")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_folder_the_kernel_refuses_files_in():
    with pytest.raises(UserError, match=r"cannot write to /proc"):
        check_out_dir_writable("/proc/run")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_for_a_normal_user(tmp_path: Path):
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(UserError, match="cannot write to"):
            check_out_dir_writable(tmp_path / "run")
    finally:
        tmp_path.chmod(0o755)


def _free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**15, 0, free))


def test_low_disk_warns_with_the_estimate(tmp_path: Path, monkeypatch, capsys):
    per_checkpoint = checkpoint_bytes(124_000_000)  # GPT-2 124M: about 2 GB a checkpoint
    assert per_checkpoint == 16 * 124_000_000
    _free(monkeypatch, 5 * per_checkpoint - 1)  # keep_last 3 + 2 checkpoints need 5
    message = warn_if_low_disk(tmp_path / "run", per_checkpoint, keep_last=3, saves=10)
    assert message is not None and str(tmp_path) in message
    assert "but 3 kept checkpoints (of 10 saved, --keep_last 3) + 1 while a save replaces the oldest + final/ need " \
           "about 9.92 GB (1.98 GB each)" in message
    assert capsys.readouterr().err == f"warning: {message}\n"


def test_the_low_disk_estimate_counts_only_the_checkpoints_the_run_saves(tmp_path: Path, monkeypatch, capsys):
    """A short run never reaches --keep_last (issue 55: the default run saves once, and the warning counted
    keep_last 3 + 2 more): it holds the checkpoints it saves, and final/.

    It counts as many as the run saves (every `--save_every` and the last, from its start step), at most `--keep_last`,
    one more while replacing, and final/.

    Seen to catch: `held_at_once` counting `keep_last` whatever the saves: a run that saves once warns."""
    assert [saves_ahead(*args) for args in [(0, 100, 100), (0, 6, 2), (0, 7, 2), (4, 6, 2), (6, 6, 2), (0, 50, 1000)]] \
        == [1, 3, 4, 1, 0, 1]
    _free(monkeypatch, 2 * 1000)
    assert warn_if_low_disk(tmp_path, 1000, keep_last=3, saves=1) is None  # one checkpoint and final/
    message = warn_if_low_disk(tmp_path, 1000, keep_last=3, saves=2)
    assert message is not None and "but 2 kept checkpoints (of 2 saved, --keep_last 3) + final/ need about" in message
    capsys.readouterr()


def test_enough_disk_is_silent(tmp_path: Path, monkeypatch, capsys):
    _free(monkeypatch, 5 * 1000)
    assert warn_if_low_disk(tmp_path, 1000, keep_last=3, saves=100) is None
    assert capsys.readouterr().err == ""
    monkeypatch.undo()  # the real filesystem has room for five 1-byte checkpoints
    assert warn_if_low_disk(tmp_path / "new" / "run", 1, keep_last=3, saves=100) is None


# ---- the validation split: refused when the run starts, not at its first evaluation ----------------------

TINY_MODEL = ["--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--block_size", "32", "--val_tokens", "256",
              "--total_batch_size", "64", "--micro_batch_size", "2", "--eval_batch_size", "2", "--max_steps", "2"]


def _small_corpus(folder: Path) -> Path:
    """About 200 tokens: the first 90% fill several training windows of 33, the last 10% not one."""
    corpus = folder / "small.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    return corpus


def test_a_validation_split_shorter_than_a_window_is_refused_with_working_advice(tmp_path: Path):
    from configs import parse_config
    from data.local import local_tokens
    from data.source import open_source
    from training.evaluations.runner import TrainingEvals

    corpus = _small_corpus(tmp_path)
    n_val = len(local_tokens(str(corpus))) - int(len(local_tokens(str(corpus))) * 0.9)
    cfg = parse_config(TINY_MODEL + ["--dataset", str(corpus), "--out_dir", str(tmp_path / "run")])
    with pytest.raises(UserError) as err:
        TrainingEvals(cfg.eval, cfg.added, open_source(cfg.data), cfg.model.block_size, cfg.training.seed,
                      accelerator=None)
    assert str(err.value) == (
        f"the validation set has {n_val} tokens, fewer than one window of block_size + 1 = 33; the validation split "
        f"of {corpus} is the last 10% of its tokens; pass --block_size {n_val - 1} or less, or add text to the corpus "
        "(about 330 tokens in all)")
    # The advice works: that block_size gives a validation window.
    smaller = parse_config(TINY_MODEL + ["--dataset", str(corpus), "--block_size", str(n_val - 1)])
    evals = TrainingEvals(smaller.eval, smaller.added, open_source(smaller.data), smaller.model.block_size,
                          smaller.training.seed, accelerator=None)
    assert len(evals.val_tokens) >= n_val


def test_advice_for_token_shards(tmp_path: Path):
    from data.settings import DataConfig
    from data.source import open_source

    (tmp_path / "manifest.json").write_text("{}")
    assert open_source(DataConfig(dataset=str(tmp_path))).val_advice(1, 1024) == (
        f"the validation split of {tmp_path} is its val_000000.bin shard; prepare the data again into a new --out "
        "with a larger `python -m data.prepare --val_tokens`")


@pytest.mark.slow
def test_train_py_stops_before_the_first_step_and_leaves_no_run_folder(tmp_path: Path):
    import subprocess

    from conftest import REPO_ROOT

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", *TINY_MODEL, "--dataset", str(_small_corpus(tmp_path)),
                           "--out_dir", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: the validation set has ")
    assert "Traceback" not in proc.stderr and "step" not in proc.stdout
    assert not out.exists()
