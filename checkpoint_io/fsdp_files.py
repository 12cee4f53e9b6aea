"""An FSDP2 run's checkpoint files: torch's distributed checkpoint, merged on one process.

FSDP2 saves the model's shards in `pytorch_model_fsdp_0/` and each optimizer's in `optimizer_<i>/`. FSDP2 reads its
own checkpoints with accelerate's `load_state`, on any number of processes. `read` is for every other reader: a
move to another engine, and `GPT.from_pretrained`. Under tensor parallelism c_attn's rows are saved in the
head-group order (`WholeState.parallelism`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from checkpoint_io.whole_state import WholeState, strip_wrapper_prefixes
from common.errors import UserError
from common.run_dir import FSDP_MODEL_DIR, fsdp_optimizer_dir


def read(folder: Path, optimizers: int) -> WholeState:
    """The model's shards (under the key "model"), merged, and the first `optimizers` optimizers' shards."""
    model = _merged(folder / FSDP_MODEL_DIR)
    states = [_merged(folder / fsdp_optimizer_dir(i)).get("optimizer", {}).get("state", {}) for i in range(optimizers)]
    return WholeState(strip_wrapper_prefixes(model.get("model", model)), [strip_wrapper_prefixes(s) for s in states])


def _merged(shards: Path) -> dict:
    """A folder of torch's distributed checkpoint, merged on this process."""
    import tempfile

    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        merged = Path(scratch) / "model.pt"
        try:
            dcp_to_torch_save(str(shards), str(merged))
        except (OSError, RuntimeError, ValueError, CheckpointException) as err:  # the last: a BaseException
            raise UserError(f"the model shards in {shards} cannot be read ({type(err).__name__}); use another "
                            "checkpoint") from None
        return torch.load(merged, map_location="cpu", weights_only=True)
