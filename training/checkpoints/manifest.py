"""A checkpoint's integrity: the manifest written last into it, and the check of every file before a resume.

`manifest.json` holds the size and sha256 of every other file. Before a resume loads anything, `verify_checkpoint`
checks that every file it reads is there and unchanged. A damaged checkpoint is one line naming the file and the
earlier checkpoint, never a traceback or a silently inexact resume. Checkpoints from before manifests (run_state
format 1) are checked for every file's presence and for readable RNG states.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from accelerate.utils import load as accelerate_load

from common.errors import UserError
from common.run_dir import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    DEEPSPEED_DIR,
    DEEPSPEED_LATEST,
    FSDP_MODEL_DIR,
    GPT_CONFIG,
    MANIFEST,
    MODEL_WEIGHTS,
    RUN_STATE,
    data_state_file,
    fsdp_optimizer_dir,
    optimizer_file,
    rng_state_file,
)
from training.checkpoints.resume import ResumePoint, fallback_advice, read_json

FORMAT = 2  # run_state.json's "format": 2 has a manifest; format 1 still resumes


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """Record the size and sha256 of every file in `folder`. Write it last into a checkpoint."""
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"version": 1, "files": files}, indent=1))


def _required_files(point: ResumePoint) -> list[str]:
    """What a resume reads: our state files and manifest, every saved rank's RNG and data state, the model and
    each optimizer."""
    names = [GPT_CONFIG, RUN_STATE] + ([MANIFEST] if point.run_state.get("format", 1) >= FORMAT else [])
    names += [rng_state_file(rank) for rank in range(point.world_size)]
    names += [data_state_file(rank) for rank in range(point.data_ranks)]
    if (point.path / ADAPTER_CONFIG).is_file():  # a LoRA run's: the adapter in place of the model
        return names + [ADAPTER_CONFIG, ADAPTER_WEIGHTS, optimizer_file(0)]
    if (point.path / FSDP_MODEL_DIR).is_dir():
        return names + [FSDP_MODEL_DIR] + [fsdp_optimizer_dir(i) for i in range(len(point.optimizers))]
    if (point.path / DEEPSPEED_DIR).is_dir():
        return names + [DEEPSPEED_DIR, DEEPSPEED_LATEST]
    return names + [MODEL_WEIGHTS] + [optimizer_file(i) for i in range(len(point.optimizers))]


def verify_checkpoint(point: ResumePoint) -> None:
    """Check that everything `load_checkpoint` will read is present and unchanged since it was saved."""
    advice = fallback_advice(point.path)
    for name in _required_files(point):
        if not (point.path / name).exists():
            raise UserError(f"checkpoint {point.path} is incomplete: {name} is missing; {advice}")
    if (point.path / MANIFEST).is_file():
        _check_against_manifest(point.path, advice)
    # accelerate logs a failed RNG load at info level and goes on, an inexact resume. So read the RNG states here
    # first, as it will: weights_only, which never runs pickled code.
    for rank in range(point.world_size):
        file = point.path / rng_state_file(rank)
        try:
            accelerate_load(file)
        except Exception as err:  # noqa: BLE001 - any failure to unpickle is a damaged file here
            raise UserError(f"checkpoint file {file} cannot be read ({type(err).__name__}); {advice}") from None


def _check_against_manifest(folder: Path, advice: str) -> None:
    files = read_json(folder / MANIFEST).get("files")
    if not isinstance(files, dict) or not all(isinstance(e, dict) and {"bytes", "sha256"} <= e.keys()
                                              for e in files.values()):
        raise UserError(f"{folder / MANIFEST} is damaged; {advice}")
    for name, entry in files.items():
        file = folder / name
        if not file.is_file():
            raise UserError(f"checkpoint {folder} is incomplete: {name} is missing; {advice}")
        if file.stat().st_size != entry["bytes"]:
            raise UserError(f"checkpoint file {file} was cut short or overwritten ({file.stat().st_size} bytes, "
                            f"{entry['bytes']} when saved); {advice}")
        if _sha256(file) != entry["sha256"]:
            raise UserError(f"checkpoint file {file} is damaged (its sha256 differs from the one saved); {advice}")


