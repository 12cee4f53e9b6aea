"""A checkpoint's manifest, and whether the files it lists are still the ones saved: the one home of that check.

`manifest.json`, written last into every checkpoint, holds the size and sha256 of every other file. Two kinds of
reader check a checkpoint against it before they read anything:
  - a resume (`resume_problem`): every file each engine lays out, and each rank's random states readable;
  - every command that reads a checkpoint's weights (`checkpoint_io.weights.resolve_weights`: `python -m
    model.export`, `model.sample`, `eval.*`, `publish.hub`, `--init_from`): the files the weights are read from.
    That is every file but those only a resume reads (the optimizers' states, the random and data states). So an
    export of a checkpoint whose optimizer state was lost still runs, and one whose weights changed never does.
A problem is one phrase naming the file, to which each reader adds its own way out. Checkpoints written before
manifests (run_state format 1) have none: a resume checks that their files are there and their random states read.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

from accelerate.utils.constants import OPTIMIZER_NAME, RNG_STATE_NAME

from common.atomic import sha256
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

FORMAT = 2  # run_state.json's "format": 2 = the checkpoint has a manifest (format 1, without, still resumes)

# The files of a checkpoint that only a resume reads (`common.run_dir`'s names): each optimizer's state (files, or
# FSDP's folders of shards), each rank's random states and data position. DeepSpeed keeps its optimizer partitions
# inside pytorch_model/, where its fp32 master weights are read from: those are the weights' own.
_RESUME_ONLY = re.compile(rf"^(?:{OPTIMIZER_NAME}(?:_\d+)?(?:\.bin)?|{RNG_STATE_NAME}_\d+\.pkl|"
                          r"data_state_rank\d+\.json)(?:/|$)")


def write_manifest(folder: Path) -> None:
    """Record the size and sha256 of every file in `folder` (the last file written into a checkpoint)."""
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"version": 1, "files": files}, indent=1))


def weights_file(name: str) -> bool:
    """True for a file (a manifest's relative name) that the weights are read from, False for a resume's own."""
    return _RESUME_ONLY.match(name) is None


def damage(folder: Path, which: Callable[[str], bool] = lambda name: True) -> str | None:
    """What is wrong with the files of checkpoint `folder` that `which` selects, against its manifest (None: they
    are the files saved, or the checkpoint is from before manifests). One phrase naming the file; the caller
    adds the way out."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return _missing_manifest(folder)
    try:
        files = json.loads(manifest.read_text()).get("files")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        files = None
    if not isinstance(files, dict) or not all(isinstance(e, dict) and {"bytes", "sha256"} <= e.keys()
                                              for e in files.values()):
        return f"checkpoint file {manifest} is damaged"
    for name, entry in files.items():
        if not which(name):
            continue
        file = folder / name
        if not file.is_file():
            return f"checkpoint {folder} is incomplete: {name} is missing"
        if file.stat().st_size != entry["bytes"]:
            return (f"checkpoint file {file} was cut short or overwritten ({file.stat().st_size} bytes, "
                    f"{entry['bytes']} when saved)")
        if sha256(file) != entry["sha256"]:
            return f"checkpoint file {file} is damaged (its sha256 differs from the one saved)"
    return None


def _missing_manifest(folder: Path) -> str | None:
    """A checkpoint whose run_state.json says it was saved with a manifest, and has none: incomplete."""
    try:
        saved = json.loads((folder / RUN_STATE).read_text()).get("format", 1)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None  # no run state to say so (a bare checkpoint of weights): nothing to check against
    return f"checkpoint {folder} is incomplete: {MANIFEST} is missing" if isinstance(saved, int) and \
        saved >= FORMAT else None


def resume_problem(folder: Path, saved_format: int, world_size: int, data_ranks: int, optimizers: int) -> str | None:
    """What is wrong with checkpoint `folder` for a resume (None: nothing). A resume reads every file the engine
    that saved it lays out (`resume_files`): each must be there, unchanged since it was saved, and each rank's random
    states must read. `saved_format` is run_state.json's "format"."""
    for name in resume_files(folder, saved_format, world_size, data_ranks, optimizers):
        if not (folder / name).exists():
            return f"checkpoint {folder} is incomplete: {name} is missing"
    if (folder / MANIFEST).is_file() and (problem := damage(folder)) is not None:
        return problem
    # accelerate swallows a failed RNG load (it logs at info level and goes on: a silently inexact resume), so the
    # RNG states are read here first, the way it will: weights_only, which never runs pickled code.
    from accelerate.utils import load as accelerate_load

    for rank in range(world_size):
        file = folder / rng_state_file(rank)
        try:
            accelerate_load(file)
        except Exception as err:  # noqa: BLE001 - any failure to unpickle is a damaged file here
            return f"checkpoint file {file} cannot be read ({type(err).__name__})"
    return None


def resume_files(folder: Path, saved_format: int, world_size: int, data_ranks: int, optimizers: int) -> list[str]:
    """The files a resume reads, as each engine lays them out: our state files and manifest, every saved rank's RNG
    and data state, then the model and each optimizer (a LoRA run's adapter, FSDP2's folders of shards, DeepSpeed's
    partitions, or a DDP run's files)."""
    names = [GPT_CONFIG, RUN_STATE] + ([MANIFEST] if saved_format >= FORMAT else [])
    names += [rng_state_file(rank) for rank in range(world_size)]
    names += [data_state_file(rank) for rank in range(data_ranks)]
    if (folder / ADAPTER_CONFIG).is_file():
        return names + [ADAPTER_CONFIG, ADAPTER_WEIGHTS, optimizer_file(0)]
    if (folder / FSDP_MODEL_DIR).is_dir():
        return names + [FSDP_MODEL_DIR] + [fsdp_optimizer_dir(i) for i in range(optimizers)]
    if (folder / DEEPSPEED_DIR).is_dir():
        return names + [DEEPSPEED_DIR, DEEPSPEED_LATEST]
    return names + [MODEL_WEIGHTS] + [optimizer_file(i) for i in range(optimizers)]
