"""A full disk while any file of a save is written: one line, no partial folder, the earlier checkpoints intact,
and `--resume latest` finishes once there is room again.

Each case makes one real write fail as the disk would: the file's own writer (torch's serializer, safetensors,
Python's file object) runs under a file-size limit of 0 bytes (`RLIMIT_FSIZE`, lowered for that call only, with
SIGXFSZ ignored), so the error is the one that writer really raises when the kernel refuses its bytes
(torch's is a RuntimeError without an errno: `[enforce fail at inline_container.cc:...] . unexpected pos ...`).

`final/` and the Hub staging too.

Seen to catch: torch's serializer RuntimeError not recognised (optimizer and RNG: a traceback); the Hub staging's
failure not caught.
"""
from __future__ import annotations

import resource
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import TINY, train_in_process
from test_faults import train_until_error

import publish.hub
import training.checkpoints.export

ARGS = TINY + ["--max_steps", "4", "--micro_batch_size", "2", "--total_batch_size", "64", "--save_every", "2",
               "--eval_every", "4", "--sample_tokens", "0"]


@contextmanager
def no_room():
    """Every write of this process fails while inside (EFBIG: a disk that takes no more bytes)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def fail_when_writing(monkeypatch, owner, name: str, target: str, where: str) -> None:
    """Patch `owner.name` (a writer whose first argument or destination names the file) so that writing `target`
    inside a folder whose name contains `where` fails as on a full disk."""
    real = getattr(owner, name)

    def writer(*args, **kwargs):
        paths = [Path(a) for a in args[:3] if isinstance(a, (str, Path))]
        if any(p.name == target and where in str(p) for p in paths):
            with no_room():
                return real(*args, **kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, writer)


CHECKPOINT_FILES = {
    # file of the step-4 checkpoint: the writer that writes it
    "model.safetensors": ("accelerate.checkpointing", "save"),
    "optimizer.bin": ("accelerate.checkpointing", "save"),
    "random_states_0.pkl": ("torch", "save"),
    "data_state_rank0.json": ("pathlib.Path", "write_text"),
    "manifest.json": ("pathlib.Path", "write_text"),
}


def _owner(dotted: str):
    import importlib

    module, _, attr = dotted.rpartition(".") if dotted == "pathlib.Path" else (dotted, "", "")
    return getattr(importlib.import_module(module), attr) if attr else importlib.import_module(module)


@pytest.mark.slow
@pytest.mark.parametrize("target", list(CHECKPOINT_FILES))
def test_each_file_of_a_checkpoint_failing_is_one_line_and_resume_finishes(tmp_path, monkeypatch, capsys, target):
    out = tmp_path / "run"
    owner, name = CHECKPOINT_FILES[target]
    if name == "write_text":  # Path.write_text(self, data): the path is the instance
        real = Path.write_text

        def write_text(self, *args, **kwargs):
            if self.name == target and ".tmp-step_000004" in str(self):
                with no_room():
                    return real(self, *args, **kwargs)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", write_text)
    else:
        fail_when_writing(monkeypatch, _owner(owner), name, target, ".tmp-step_000004")
    last = train_until_error(monkeypatch, capsys, ARGS + ["--out_dir", str(out)])
    assert last.startswith("error: could not write checkpoint step_000004 in "), last
    assert "free disk space" in last and "--resume latest" in last
    if target in ("optimizer.bin", "random_states_0.pkl"):
        assert "torch's writer failed, most often on a full disk" in last  # torch's RuntimeError, recognised
    assert not list(out.rglob(".tmp-*")) and not (out / "final").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002"]
    monkeypatch.undo()
    train_in_process(ARGS + ["--out_dir", str(out), "--resume", "latest"])
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_the_final_export_and_the_hub_staging_failing_are_one_line(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real_save = training.checkpoints.export.save_state_dict

    def save_without_room(*args, **kwargs):
        with no_room():
            return real_save(*args, **kwargs)

    monkeypatch.setattr(training.checkpoints.export, "save_state_dict", save_without_room)
    last = train_until_error(monkeypatch, capsys, ARGS + ["--out_dir", str(out)])
    assert last.startswith(f"error: could not write {out / 'final'} (") and "--resume latest" in last, last
    assert not list(out.rglob(".tmp-*")) and not (out / "final").exists()
    monkeypatch.undo()
    train_in_process(ARGS + ["--out_dir", str(out), "--resume", "latest"])  # writes final/ only
    assert (out / "final" / "model.safetensors").is_file()

    real_build = publish.hub.build_hf_folder

    def build_without_room(*args, **kwargs):
        with no_room():
            return real_build(*args, **kwargs)

    monkeypatch.setattr(publish.hub, "build_hf_folder", build_without_room)
    from common.errors import UserError

    with pytest.raises(UserError, match=r"could not write the Hub export in .*; free disk space and push again"):
        publish.hub.stage_export(out)
    assert not list((out / "hub_export").glob(".tmp-*")) and not (out / "hub_export" / "model").exists()
    monkeypatch.undo()
    export, _ = publish.hub.stage_export(out)
    assert (export / "model.safetensors").is_file()


def test_files_moved_into_place_get_the_plain_mode(tmp_path):
    """Issue 44: safetensors creates its files 0600, so a teammate could not read the weights of a shared --out_dir
    while every other file was 0644. Whatever `rename_into_place` moves gets the mode `open()` gives (0666 less the
    umask), the same for a folder's files.

    Seen to catch: the chmod off: 0600 stays, the test fails."""
    import os

    from common.atomic import rename_into_place, temp_path

    old = os.umask(0o022)
    try:
        folder_tmp = temp_path(tmp_path / "final")
        folder_tmp.mkdir()
        for name in ("model.safetensors", "config.json"):
            (folder_tmp / name).write_text("x")
        os.chmod(folder_tmp / "model.safetensors", 0o600)  # as safetensors writes it
        rename_into_place(folder_tmp, tmp_path / "final")
        single = temp_path(tmp_path / "one.safetensors")
        single.write_text("x")
        os.chmod(single, 0o600)
        rename_into_place(single, tmp_path / "one.safetensors")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [*(tmp_path / "final").iterdir(), tmp_path / "one.safetensors"]}
    assert modes == {"model.safetensors": 0o644, "config.json": 0o644, "one.safetensors": 0o644}
