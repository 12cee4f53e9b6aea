"""A checkpoint read whole on one process, whichever engine wrote it.

`read_state(folder)` reads the weights: `GPT.from_pretrained` reads a checkpoint this way, and so do sample, eval,
export and the Hub push. `read_state(folder, groups)` reads each optimizer's state too: a move reads any engine's
checkpoint this way before each rank takes its piece (`training.checkpoints.moving`). The files tell which engine
wrote them: FSDP2's shards, DeepSpeed's partitions, else a DDP run's files (a pipeline's and one process's too).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from checkpoint_io import ddp_files, fsdp_files, zero_files
from checkpoint_io.ddp_files import Groups
from checkpoint_io.whole_state import WholeState
from common.parallelism import Parallelism
from common.run_dir import DEEPSPEED_DIR, FSDP_MODEL_DIR, GPT_CONFIG, RUN_STATE


def read_config(folder: Path) -> dict[str, Any]:
    """The architecture the checkpoint was saved with, as saved (`asdict(GPTConfig)`); a ValueError if it is not
    JSON."""
    return json.loads((folder / GPT_CONFIG).read_text())


def read_state(folder: Path, groups: Groups | None = None) -> WholeState:
    """The checkpoint in `folder`, read whole on this process: its weights, and with `groups` (how one process's
    optimizers number the model's parameters) each optimizer's state."""
    saved_as = _saved_parallelism(folder)
    if (folder / FSDP_MODEL_DIR).is_dir():
        state = fsdp_files.read(folder, len(groups or ()))
    elif (folder / DEEPSPEED_DIR).is_dir():
        state = zero_files.read(folder, bool(groups))
    else:
        state = ddp_files.read(folder, groups or [])
    return replace(state, parallelism=saved_as)


def _saved_parallelism(folder: Path) -> Parallelism:
    """The launch the checkpoint was saved under (run_state.json's engine record, `Parallelism.of_record`). A folder
    without the record (a bare checkpoint, or one saved before it) was not split."""
    try:
        engine = json.loads((folder / RUN_STATE).read_text()).get("engine")
    except (OSError, json.JSONDecodeError, AttributeError):
        engine = None
    return Parallelism.of_record(engine) if isinstance(engine, dict) else Parallelism()
