"""A DeepSpeed ZeRO run's checkpoint files, as a move reads them and as a move writes into a ZeRO launch.

DeepSpeed saves one optimizer partition per rank under `DEEPSPEED_DIR`: flat fp32 master weights and AdamW's
moments. A ZeRO launch on the same world reads them itself (accelerate's `load_state`). Another launch reads them
whole with DeepSpeed's own zero_to_fp32 merge (`read_optimizer`); a ZeRO launch that was not the one that saved them
loads the whole state through DeepSpeed's universal checkpoint layout (`load_into`).
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator

from checkpoint_io.whole_state import WholeState
from common.errors import UserError
from model.pretrained import deepspeed_quietly, strip_wrapper_prefixes


def read_optimizer(folder: Path) -> dict[str, dict[str, Any]]:
    """DeepSpeed ZeRO's AdamW state, merged whole by DeepSpeed's own zero_to_fp32 code. The moments are laid out as
    the fp32 master weights it merges."""
    with deepspeed_quietly():
        return _merge_moments(folder)


def _merge_moments(folder: Path) -> dict[str, dict[str, Any]]:
    from deepspeed.utils import zero_to_fp32 as ds

    model_states = ds.parse_model_states(ds.get_model_state_files(str(folder)))
    saved = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
             for f in ds.get_optim_files(str(folder))]  # the checkpoint's own files (its manifest verified them)
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
            for name, state in strip_wrapper_prefixes(moments).items()}


def load_into(read: Callable[[], WholeState], engine: Any, accelerator: Accelerator, scratch: Path) -> None:
    """Load the whole state (`read()`) into DeepSpeed's ZeRO optimizer through the universal checkpoint layout.

    One process per node reads and writes it in `scratch`; each rank loads its partition of the fp32 master weights
    and AdamW's moments. ZeRO-1/2 then copy the master weights into the model's; ZeRO-3's partitions are the model's.
    `scratch` is removed after."""
    optimizer = engine.optimizer
    base = optimizer.optimizer
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in base.param_groups]
    done = scratch / "written"
    failure: BaseException | None = None
    if accelerator.is_local_main_process:
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            _write_universal(read(), optimizer, hyper, scratch / "zero")
            done.touch()
        except BaseException as err:  # noqa: BLE001 - raised below, once the other processes are released
            failure = err
    accelerator.wait_for_everyone()
    try:
        if failure is not None:
            raise failure
        if not done.is_file():
            raise UserError(f"the moved checkpoint could not be written in {scratch} (the first process of this node "
                            "says why); free space there (or set TMPDIR) and resume again", on_every_rank=True)
        # Bracketed as DeepSpeed's own load_checkpoint does: ZeRO-3 first releases every gathered parameter, then
        # gathers its persistent ones (small parameters each rank keeps whole) from the loaded partitions.
        for event in ("checkpoint_event_prologue", None, "checkpoint_event_epilogue"):
            if event is None:
                optimizer._load_universal_checkpoint(str(scratch), load_optimizer_states=True,
                                                     load_from_fp32_weights=True)
            elif hasattr(optimizer, event):
                getattr(optimizer, event)()
    finally:
        accelerator.wait_for_everyone()
        if accelerator.is_local_main_process:
            shutil.rmtree(scratch, ignore_errors=True)
    # ZeRO-3 gives every group the first one's settings (the matrices' weight decay to biases and LayerNorms too),
    # and one step tensor to all, which AdamW would then advance once per group.
    for group, own in zip(base.param_groups, hyper, strict=True):
        group.update(own)
    for saved in base.state.values():
        if torch.is_tensor(saved.get("step")):
            saved["step"] = saved["step"].clone()
    if engine.zero_optimization_stage() < 3:
        optimizer.update_lp_params()


def _write_universal(state: WholeState, optimizer: Any, hyper: list[dict], zero: Path) -> None:
    """`state` in DeepSpeed's universal checkpoint layout under `zero`. Each parameter gets a folder, by DeepSpeed's
    name, with fp32.pt, exp_avg.pt, exp_avg_sq.pt ({"param": whole tensor}) and step.pt. optimizer_state.pt holds
    this run's group settings, which the load keeps."""
    import deepspeed

    step = None
    for param, name in optimizer.param_names.items():
        plain = next(iter(strip_wrapper_prefixes({name: param})))
        saved = state.state(0, plain)
        if saved is None:
            raise UserError(f"the checkpoint holds no optimizer state for {plain}; resume it with the optimizer it "
                            "was saved with")
        folder = zero / name
        folder.mkdir(parents=True)
        torch.save({"param": state.weight(plain).float()}, folder / "fp32.pt")
        for key in ("exp_avg", "exp_avg_sq"):
            torch.save({"param": saved[key].float()}, folder / f"{key}.pt")
        step = saved["step"]
        torch.save(step, folder / "step.pt")
    torch.save({"ds_version": deepspeed.__version__, "clip_grad": optimizer.clip_grad, "param_groups": hyper,
                "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": hyper}},
               zero / "optimizer_state.pt")
