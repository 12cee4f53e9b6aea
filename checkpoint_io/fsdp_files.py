"""An FSDP2 run's checkpoint files, as a move reads them.

FSDP2 saves torch's distributed checkpoint: each optimizer's shards in `fsdp_optimizer_dir(i)` (the weights beside
them, which `model.pretrained.read_checkpoint` reads whole for any command). Under tensor parallelism c_attn's rows
are in the head-group order; read whole, they are put back in Hugging Face's. FSDP2 reads its own checkpoints with
accelerate's `load_state`, on any number of processes; this reader is for a move to another engine.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from model import GPTConfig
from model.pretrained import read_distributed_checkpoint, strip_wrapper_prefixes
from model.tensor_parallel import natural_order


def read_optimizer(folder: Path, config: GPTConfig, degree: int) -> dict[str, dict[str, Any]]:
    """FSDP2's optimizer shards merged by parameter name, c_attn's rows back in Hugging Face's order."""
    states = strip_wrapper_prefixes(read_distributed_checkpoint(folder).get("optimizer", {}).get("state", {}))
    keys = {key for state in states.values() for key in state}
    by_key = {key: natural_order({name: s[key] for name, s in states.items() if key in s}, config.n_embd, degree)
              for key in keys}
    return {name: {key: by_key[key][name] for key in state} for name, state in states.items()}
