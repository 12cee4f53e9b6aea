"""Checkpoints that move: resumed under another engine, tensor-parallel degree or (for ZeRO) number of processes
than the launch that saved them.

Each engine saves in its own format: DDP whole files, FSDP2 torch's distributed checkpoint of its shards, DeepSpeed
one optimizer partition per rank. The engine that saved a checkpoint reads it with accelerate's `load_state`, bit
for bit (FSDP2 also reshards over another number of processes). Any other launch reads the state whole
(`WholeState`): weights and optimizer states by parameter name, c_attn in Hugging Face's order. Then each rank takes
its own piece:

- DDP, FSDP2 and tensor parallelism: every tensor is copied in, a DTensor keeping its own shard. Each rank holds the
  whole, so `distribute_tensor(..., src_data_rank=None)` sends nothing.
- A pipeline stage: the state is written as a DDP run's files in a scratch folder (`ddp_files`), which the stage
  reads as it reads a pipeline checkpoint.
- DeepSpeed ZeRO-1/2/3: one process per node writes the state in DeepSpeed's universal checkpoint layout in a
  scratch folder. Every rank's ZeRO optimizer loads its partitions from it; the folder is removed after.

Under DDP and FSDP2 every process holds the whole state in CPU memory for the seconds of the load (12 bytes a
parameter with AdamW). That is the price of reading any layout into any other without a conversion step.

The step, tokens, learning rate and data position carry over (the loaders keep one global cursor). The RNG streams
(dropout) carry over on as many processes as saved them; on another number they start afresh, which the run
announces and config.yaml's `resumes:` records. The resumed run ends within float rounding of one that never moved,
not bit for bit: summation orders differ between engines.
"""
from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor, distribute_tensor

from common.engine_names import DDP, DEEPSPEED, FSDP
from common.errors import UserError
from common.run_dir import DEEPSPEED_DIR, fsdp_optimizer_dir, rng_state_file
from model import GPT, GPTConfig
from model.pretrained import deepspeed_quietly, read_checkpoint, read_distributed_checkpoint, strip_wrapper_prefixes
from model.tensor_parallel import natural_order, parallel_order
from model.unwrap import unwrapped
from training.checkpoints import ddp_files
from training.checkpoints.resume import ResumePoint
from training.distributed.engines import Engine
from training.distributed.pipeline import TIED, PipelinedGPT
from training.optimizers.spec import OptimizerPlan

_TIED_PAIR = {TIED: "lm_head.weight", "lm_head.weight": TIED}


@dataclass(frozen=True)
class Move:
    """A resume that changes how the model is held: from the checkpoint's engine and processes to the launch's."""

    saved: Engine
    saved_world: int
    now: Engine
    world: int
    plan: OptimizerPlan  # the run's optimizers (how a DDP checkpoint numbers the parameters)

    @property
    def keeps_random_streams(self) -> bool:
        """Whether every rank's RNG state carries over. It needs the same number of processes; with another, some
        ranks' streams have no owner or no state."""
        return self.world == self.saved_world

    @property
    def not_carried(self) -> str | None:
        """What the move cannot carry over, for config.yaml's `resumes:`; None when it carries everything."""
        return None if self.keeps_random_streams else NOT_CARRIED

    @property
    def before(self) -> str:
        return f"{self.saved.name} on {self.saved_world} process(es)"

    @property
    def after(self) -> str:
        return f"{self.now.name} on {self.world} process(es)"

    def announcement(self, checkpoint: Path) -> str:
        kept = ("weights, optimizer state, step, data position and random streams carry over" if
                self.keeps_random_streams else "weights, optimizer state, step and data position carry over")
        rest = f"; {self.not_carried} start afresh" if self.not_carried else ""
        return (f"note: {checkpoint.name} was saved under {self.before}, this launch runs {self.after}: its {kept} "
                f"(the run ends within float rounding of one that never moved){rest}")


NOT_CARRIED = "per-rank random streams (dropout)"  # what a move cannot carry: the RNG states of ranks that may be gone


def checkpoint_move(point: ResumePoint | None, engine: Engine, world_size: int, plan: OptimizerPlan) -> Move | None:
    """The `Move` of resuming `point` under `engine` on `world_size` processes. None where the saving engine reads it
    itself: the same engine and degree, and for DeepSpeed the same number of processes (its partitions do not
    reshard). A pipeline's checkpoint is a DDP run's files, whatever the degree."""
    if point is None:
        return None
    saved = Engine.of_record(point.engine)
    if replace(saved, pipeline_parallel=engine.pipeline_parallel) == engine and not (
            engine.kind == DEEPSPEED and point.world_size != world_size):
        return None
    if saved.kind not in (DDP, FSDP, DEEPSPEED):
        raise UserError(f"{point.path} records an engine this version does not know ({saved.kind!r}); resume it "
                        "with the version that saved it")
    if DEEPSPEED in (saved.kind, engine.kind) and plan.spec.zero_build is not None:
        raise UserError(f"{point.path.name} was saved under {saved.name} on {point.world_size} process(es), this "
                        f"launch runs {engine.name} on {world_size}: --optimizer {plan.kind}'s state does not move "
                        f"to or from DeepSpeed's ZeRO, whose {plan.spec.display} keeps it in its own flat partitions "
                        f"(training.optimizers.muon_deepspeed); resume it under {saved.name} on {point.world_size} "
                        "process(es)")
    return Move(saved, point.world_size, engine, world_size, plan)


@dataclass
class WholeState:
    """A checkpoint's state, whole, by our GPT's parameter names, c_attn in Hugging Face's order: `weights`, and each
    optimizer's state per parameter (AdamW: exp_avg, exp_avg_sq, step; Muon: momentum_buffer)."""

    weights: dict[str, torch.Tensor]
    optimizers: list[dict[str, dict[str, Any]]]

    def weight(self, name: str) -> torch.Tensor:
        """The weight `name`; the token embedding and the output layer are one tensor (tied)."""
        found = self.weights.get(name, self.weights.get(_TIED_PAIR.get(name, "")))
        if found is None:
            raise UserError(f"the checkpoint holds no weight {name}; resume it with the model it was saved with")
        return found

    def state(self, index: int, name: str) -> dict[str, Any] | None:
        states = self.optimizers[index]
        return states.get(name, states.get(_TIED_PAIR.get(name, "")))


def read_whole(point: ResumePoint, config: GPTConfig, plan: OptimizerPlan) -> WholeState:
    """`point`'s weights and optimizer states, whole, on this process: the size of one DDP checkpoint."""
    _, weights = read_checkpoint(point.path)
    engine = Engine.of_record(point.engine)
    if engine.kind == FSDP:
        optimizers = [_read_fsdp_optimizer(point.path / fsdp_optimizer_dir(i), config, engine.tensor_parallel)
                      for i in range(len(point.optimizers))]
    elif engine.kind == DEEPSPEED:
        optimizers = [_read_zero_optimizer(point.path / DEEPSPEED_DIR)]
    else:
        optimizers = [ddp_files.read_optimizer(point.path, i, groups)[0]
                      for i, groups in enumerate(ddp_files.whole_groups(config, plan))]
    return WholeState(weights, optimizers)


def _read_fsdp_optimizer(folder: Path, config: GPTConfig, degree: int) -> dict[str, dict[str, Any]]:
    """FSDP2's optimizer shards merged by parameter name, c_attn's rows back in Hugging Face's order."""
    states = strip_wrapper_prefixes(read_distributed_checkpoint(folder).get("optimizer", {}).get("state", {}))
    keys = {key for state in states.values() for key in state}
    by_key = {key: natural_order({name: s[key] for name, s in states.items() if key in s}, config.n_embd, degree)
              for key in keys}
    return {name: {key: by_key[key][name] for key in state} for name, state in states.items()}


def _read_zero_optimizer(folder: Path) -> dict[str, dict[str, Any]]:
    """DeepSpeed ZeRO's AdamW state, merged whole by DeepSpeed's own zero_to_fp32 code. The moments are laid out as
    the fp32 master weights it merges."""
    with deepspeed_quietly():
        return _merge_zero_moments(folder)


def _merge_zero_moments(folder: Path) -> dict[str, dict[str, Any]]:
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


def load_moved(point: ResumePoint, move: Move, config: GPTConfig, model: torch.nn.Module, optimizers: list,
               accelerator: Accelerator) -> None:
    """Load `point` into this rank's prepared `model` and `optimizers`, and its random stream where that carries over.
    Call on every rank."""
    if move.now.kind == DEEPSPEED:
        # One folder per checkpoint path, so a node's processes agree on it. The run folder's lock keeps any other
        # launch out of it.
        digest = hashlib.sha256(str(point.path.resolve()).encode()).hexdigest()[:16]
        scratch = Path(tempfile.gettempdir()) / f"gpt2-accelerate-moved-{digest}"
        _load_into_zero(lambda: read_whole(point, config, move.plan), model, accelerator, scratch)
    else:
        load_whole(read_whole(point, config, move.plan), model, optimizers, config, move.now)
    if move.keeps_random_streams:
        restore_random_streams(point.path, accelerator.process_index)


def load_whole(state: WholeState, model: torch.nn.Module, optimizers: list, config: GPTConfig,
               engine: Engine) -> None:
    """Give this rank's torch model (plain, sharded, split or a pipeline stage) and optimizers their pieces of
    `state`."""
    if isinstance(model, PipelinedGPT):
        with tempfile.TemporaryDirectory(prefix="moved-") as scratch:
            groups = ddp_files.whole_groups(config, model.plan)
            weights = {name: state.weight(name) for name in _whole_names(config)}
            states = [{name: found for name in (n for group in optimizer_groups for n in group)
                       if (found := state.state(index, name)) is not None}
                      for index, optimizer_groups in enumerate(groups)]
            ddp_files.write(Path(scratch), weights, states, groups)
            ddp_files.load_into_stage(model, Path(scratch))
    else:
        _load_into_torch(state, model, optimizers, config, engine.tensor_parallel)


def _whole_names(config: GPTConfig) -> list[str]:
    """Our GPT's weights' names, in its order."""
    with torch.device("meta"):
        return list(GPT(config).state_dict())


def _piece(value: Any, like: torch.Tensor) -> Any:
    """`value`, whole, as `like` holds it: a DTensor's own shard, on its device. A tensor of another shape (AdamW's
    step) stays as it is. Always a copy: an optimizer updates its state in place, so a shared tensor would advance
    twice."""
    if not torch.is_tensor(value):
        return value
    if value.shape != like.shape:
        return value.clone()
    value = value.to(device=like.device, dtype=like.dtype if value.is_floating_point() else value.dtype, copy=True)
    if isinstance(like, DTensor):
        return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
    return value


def _load_into_torch(state: WholeState, model: torch.nn.Module, optimizers: list, config: GPTConfig,
                     degree: int) -> None:
    params = strip_wrapper_prefixes(dict(unwrapped(model).named_parameters()))
    ordered = WholeState(parallel_order(state.weights, config.n_embd, degree),
                         [_parallel_states(s, config.n_embd, degree) for s in state.optimizers])
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(_piece(ordered.weight(name), param))
    names = {id(p): name for name, p in params.items()}
    for index, optimizer in enumerate(optimizers):
        inner = getattr(optimizer, "optimizer", optimizer)
        for group in inner.param_groups:
            for param in group["params"]:
                saved = ordered.state(index, names[id(param)])
                if saved is None:
                    raise UserError(f"the checkpoint holds no optimizer state for {names[id(param)]}; resume it with "
                                    "the optimizer it was saved with")
                inner.state[param] = {key: _piece(value, param) for key, value in saved.items()}


def _parallel_states(states: dict[str, dict[str, Any]], n_embd: int, degree: int) -> dict[str, dict[str, Any]]:
    """Each parameter's optimizer state with c_attn's rows in the head-group order of tensor parallelism."""
    if degree == 1:
        return states
    keys = {key for s in states.values() for key in s if torch.is_tensor(s[key]) and s[key].dim()}
    by_key = {key: parallel_order({n: s[key] for n, s in states.items() if key in s}, n_embd, degree)
              for key in keys}
    return {name: {key: by_key[key][name] if key in by_key else value for key, value in s.items()}
            for name, s in states.items()}


def _load_into_zero(read: Callable[[], WholeState], engine: Any, accelerator: Accelerator, scratch: Path) -> None:
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


def restore_random_streams(checkpoint: Path, rank: int) -> None:
    """Restore this process's RNG states from `checkpoint`: Python's, NumPy's, torch's CPU generator and the GPUs'.
    Every engine writes accelerate's `random_states_<rank>.pkl`; it is read weights-only, as accelerate reads it."""
    import random

    import numpy as np
    from accelerate.utils import load

    states = load(checkpoint / rng_state_file(rank))
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
