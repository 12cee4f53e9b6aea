"""A DeepSpeed ZeRO run's checkpoint files, read whole, and the universal layout that a move writes for a ZeRO launch.

DeepSpeed saves one partition per rank under `pytorch_model/`: flat fp32 master weights and AdamW's moments. A ZeRO
launch on the same world reads them itself (accelerate's `load_state`). Any other reader merges them with
DeepSpeed's own zero_to_fp32 code (`read_weights`, `read_optimizer`). A ZeRO launch that did not save them loads a
whole state from DeepSpeed's universal checkpoint layout (`write_universal`).
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any, Iterator

import torch

from checkpoint_io.whole_state import WholeState, strip_wrapper_prefixes
from common.errors import UserError
from common.run_dir import DEEPSPEED_DIR


@contextlib.contextmanager
def deepspeed_quietly() -> Iterator[None]:
    """DeepSpeed's checkpoint readers print what they parse and draw progress bars, on every rank: not a user's
    business (their errors are exceptions, which pass)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def read(folder: Path, optimizer: bool) -> WholeState:
    """The partitions merged by DeepSpeed's own zero_to_fp32 code: its fp32 master weights and, with `optimizer`,
    AdamW's state by parameter name (ZeRO holds one optimizer). The moments are laid out as the master weights."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise UserError(f"{folder} is a DeepSpeed checkpoint, and reading it needs DeepSpeed; pip install -e "
                        "\".[deepspeed]\"") from None
    with deepspeed_quietly():
        weights = get_fp32_state_dict_from_zero_checkpoint(str(folder))
        states = [_merge_moments(folder / DEEPSPEED_DIR)] if optimizer else []
    return WholeState(strip_wrapper_prefixes(weights), [strip_wrapper_prefixes(s) for s in states])


def _merge_moments(partitions: Path) -> dict[str, dict[str, Any]]:
    from deepspeed.utils import zero_to_fp32 as ds

    model_states = ds.parse_model_states(ds.get_model_state_files(str(partitions)))
    saved = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
             for f in ds.get_optim_files(str(partitions))]  # the checkpoint's own files (its manifest verified them)
    stage = saved[0]["zero_stage"]
    world = max(saved[0]["partition_count"]) if isinstance(saved[0]["partition_count"], list) else saved[0][
        "partition_count"]
    base = [s["base_optimizer_state" if stage <= 2 else "optimizer_state_dict"]["state"] for s in saved]
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for key in ("exp_avg", "exp_avg_sq"):
        flat = [[state[group][key] for group in sorted(state)] for state in base]
        merged: dict[str, Any] = {}
        if stage <= 2:
            ds._zero2_merge_trainable_params(merged, world, flat, model_states,
                                             saved[0].get("param_alignment_paddings"))
        else:
            ds._zero3_merge_trainable_params(merged, world, flat, model_states)
        for name, tensor in ds.to_torch_tensor(merged).items():
            moments.setdefault(name, {})[key] = tensor.clone()
    step = base[0][min(base[0])]["step"]
    return {name: {"step": step.clone() if torch.is_tensor(step) else torch.tensor(float(step)), **state}
            for name, state in moments.items()}


def write_universal(weights: dict[str, torch.Tensor], states: dict[str, dict[str, Any]], hyper: list[dict],
                    clip_grad: float, folder: Path) -> None:
    """A whole state in DeepSpeed's universal checkpoint layout under `folder`, both dicts by DeepSpeed's parameter
    names: a folder per parameter with fp32.pt, exp_avg.pt, exp_avg_sq.pt ({"param": whole tensor}) and step.pt.
    optimizer_state.pt holds the param groups' settings `hyper` and the clipping, which a load keeps."""
    import deepspeed

    step = None
    for name, weight in weights.items():
        saved = states[name]
        (folder / name).mkdir(parents=True)
        torch.save({"param": weight.float()}, folder / name / "fp32.pt")
        for key in ("exp_avg", "exp_avg_sq"):
            torch.save({"param": saved[key].float()}, folder / name / f"{key}.pt")
        step = saved["step"]
        torch.save(step, folder / name / "step.pt")
    torch.save({"ds_version": deepspeed.__version__, "clip_grad": clip_grad, "param_groups": hyper,
                "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": hyper}},
               folder / "optimizer_state.pt")
