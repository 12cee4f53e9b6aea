"""Checkpoints that move: resumed under another engine, tensor-parallel degree or (for ZeRO) number of processes
than the launch that saved them.

The engine that saved a checkpoint reads it with accelerate's `load_state`, bit for bit (FSDP2 also reshards over
another number of processes). Any other launch reads the state whole with `checkpoint_io` (`read_whole`), which
knows each engine's files: weights and optimizer states by parameter name, named and ordered as this launch holds
them. Then each rank takes its own piece:

- DDP, FSDP2 and tensor parallelism: every tensor is copied in, a DTensor keeping its own shard. Each rank holds the
  whole, so `distribute_tensor(..., src_data_rank=None)` sends nothing.
- A pipeline stage: its own part, by name, as it takes it from a pipeline's own checkpoint.
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

from checkpoint_io import zero_files
from checkpoint_io.ddp_files import Groups
from checkpoint_io.reader import read_state
from checkpoint_io.whole_state import WholeState, plain_name, strip_wrapper_prefixes
from common.engine_names import DDP, DEEPSPEED, FSDP
from common.errors import UserError
from common.parallelism import Parallelism
from common.run_dir import rng_state_file
from model import GPT, GPTConfig
from model.config import TIED, TIED_OUTPUT
from model.tensor_parallel import reordered
from model.unwrap import unwrapped
from training.checkpoints.resume import ResumePoint
from training.distributed.pipeline import PipelinedGPT
from training.optimizers.plan import build_optimizer
from training.optimizers.spec import OptimizerPlan

_GROUPS: dict[tuple[str, str], Groups] = {}


@dataclass(frozen=True)
class Move:
    """A resume that changes how the model is held: from the checkpoint's engine and processes to the launch's."""

    saved: Parallelism
    saved_world: int
    now: Parallelism
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


def checkpoint_move(point: ResumePoint | None, engine: Parallelism, world_size: int,
                    plan: OptimizerPlan) -> Move | None:
    """The `Move` of resuming `point` under `engine` on `world_size` processes. None where the saving engine reads it
    itself: the same engine and the same degrees its files depend on (`Parallelism.checkpoint_layout`: a pipeline's
    checkpoint is a DDP run's files, whatever its degree), and for DeepSpeed the same number of processes (its
    partitions do not reshard)."""
    if point is None:
        return None
    saved = Parallelism.of_record(point.engine)
    if saved.checkpoint_layout == engine.checkpoint_layout and not (
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


def whole_groups(config: GPTConfig, plan: OptimizerPlan) -> Groups:
    """How one process's optimizers number the whole model's parameters, which a DDP run's optimizer files are
    numbered by. Computed once per model and optimizer, on the meta device."""
    key = (repr(config), plan.kind)
    if key not in _GROUPS:
        with torch.device("meta"):
            whole = GPT(config)
        names = {id(p): name for name, p in whole.named_parameters()}
        _GROUPS[key] = [[[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
                        for optimizer in build_optimizer(whole, plan, "cpu")]
    return _GROUPS[key]


def read_whole(point: ResumePoint, config: GPTConfig, plan: OptimizerPlan, now: Parallelism) -> WholeState:
    """`point`'s weights and optimizer states, whole, on this process (the size of one DDP checkpoint), as a launch of
    `now` holds them: the tied pair under both its names, c_attn's rows in its tensor-parallel order."""
    saved = read_state(point.path, whole_groups(config, plan))
    was, n_embd = saved.parallelism, config.n_embd
    optimizers = [_reordered(_tied(states), n_embd, was, now) for states in saved.optimizers]
    weights = reordered(_tied(saved.weights), n_embd, was, now)
    return replace(saved, weights=weights, optimizers=optimizers, parallelism=now)


def _tied(by_name: dict[str, Any]) -> dict[str, Any]:
    """`by_name` with the tied pair's one tensor (or state) under both its names: a checkpoint holds it once."""
    one = by_name.get(TIED, by_name.get(TIED_OUTPUT))
    return by_name if one is None else {**by_name, TIED: one, TIED_OUTPUT: one}


def _reordered(states: dict[str, dict[str, Any]], n_embd: int, was: Parallelism,
               now: Parallelism) -> dict[str, dict[str, Any]]:
    """Each parameter's optimizer state with c_attn's rows from the order `was` holds them in into `now`'s
    (`model.tensor_parallel.reordered`): a moment is laid out as its parameter."""
    keys = {key for s in states.values() for key in s if torch.is_tensor(s[key]) and s[key].dim()}
    by_key = {key: reordered({n: s[key] for n, s in states.items() if key in s}, n_embd, was, now) for key in keys}
    return {name: {key: by_key[key][name] if key in by_key else value for key, value in s.items()}
            for name, s in states.items()}


def load_moved(point: ResumePoint, move: Move, config: GPTConfig, model: torch.nn.Module, optimizers: list,
               accelerator: Accelerator) -> None:
    """Load `point` into this rank's prepared `model` and `optimizers`, and its random stream where that carries over
    (first: loading draws no random numbers). The optimizers keep this run's param-group settings. Call on every
    rank."""
    if move.keeps_random_streams:
        restore_random_streams(point.path, accelerator.process_index)
    if move.now.kind == DEEPSPEED:
        # One folder per checkpoint path, so a node's processes agree on it. The run folder's lock keeps any other
        # launch out of it.
        digest = hashlib.sha256(str(point.path.resolve()).encode()).hexdigest()[:16]
        scratch = Path(tempfile.gettempdir()) / f"gpt2-accelerate-moved-{digest}"
        _load_into_zero(lambda: read_whole(point, config, move.plan, move.now), model, accelerator, scratch)
    else:
        state = read_whole(point, config, move.plan, move.now)
        load_whole(replace(state, settings=None), model, optimizers, point.path)


def load_whole(state: WholeState, model: torch.nn.Module, optimizers: list, source: Path) -> None:
    """Give this rank's torch model (plain, sharded, split or a pipeline stage) and optimizers their pieces of
    `state` (`read_whole`). A stage takes the param-group settings `state` holds too (a pipeline's own files); other
    optimizers keep theirs. `source` names the checkpoint in errors."""
    if isinstance(model, PipelinedGPT):
        groups = whole_groups(model.config, model.plan)
        states = [{name: state.optimizers[index][name] for name in (n for group in optimizer_groups for n in group)
                   if name in state.optimizers[index]} for index, optimizer_groups in enumerate(groups)]
        settings = state.settings or [[{} for _ in optimizer_groups] for optimizer_groups in groups]
        weights = {name: _weight_of(state, name) for name in _whole_names(model.config)}
        model.load_own(weights, states, settings, source)
    else:
        _load_into_torch(state, model, optimizers)


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


def _load_into_torch(state: WholeState, model: torch.nn.Module, optimizers: list) -> None:
    params = strip_wrapper_prefixes(dict(unwrapped(model).named_parameters()))
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(_piece(_weight_of(state, name), param))
    names = {id(p): name for name, p in params.items()}
    for index, optimizer in enumerate(optimizers):
        inner = getattr(optimizer, "optimizer", optimizer)
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param] = {key: _piece(value, param)
                                      for key, value in _state_of(state, index, names[id(param)]).items()}


def _weight_of(state: WholeState, name: str) -> torch.Tensor:
    if name not in state.weights:
        raise UserError(f"the checkpoint holds no weight {name}; resume it with the model it was saved with")
    return state.weights[name]


def _state_of(state: WholeState, index: int, name: str) -> dict[str, Any]:
    saved = state.optimizers[index].get(name)
    if saved is None:
        raise UserError(f"the checkpoint holds no optimizer state for {name}; resume it with the optimizer it was "
                        "saved with")
    return saved


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
            state = read()
            names = {name: plain_name(name) for name in optimizer.param_names.values()}  # DeepSpeed's: ours
            zero_files.write_universal({name: _weight_of(state, plain) for name, plain in names.items()},
                                       {name: _state_of(state, 0, plain) for name, plain in names.items()},
                                       hyper, optimizer.clip_grad, scratch / "zero")
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


def restore_random_streams(checkpoint: Path, rank: int) -> None:
    """Restore this process's RNG states from `checkpoint`: Python's, NumPy's, torch's CPU generator and the GPUs'.
    Every engine writes accelerate's `random_states_<rank>.pkl`; it is read weights-only, as accelerate reads it."""
    import random

    import numpy as np
    from accelerate.utils import load as accelerate_load

    states = accelerate_load(checkpoint / rng_state_file(rank))
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
