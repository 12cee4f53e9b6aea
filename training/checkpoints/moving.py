"""Checkpoints that move: resumed under another engine, tensor-parallel degree or (for ZeRO) number of processes
than the launch that saved them.

Each engine saves in its own format, and each format has its module here: `ddp_files` (DDP and a pipeline's
stages), `fsdp_files` (FSDP2's distributed checkpoint), `zero_files` (DeepSpeed's partitions); the weights of any
of them `model.pretrained.read_checkpoint` reads (`from_pretrained` reads a checkpoint without a launcher). The
engine that saved a checkpoint reads it with accelerate's `load_state`, bit for bit (FSDP2 also reshards over
another number of processes). Any other launch reads the state whole (`WholeState`): weights and optimizer states
by parameter name, c_attn in Hugging Face's order. Then each rank takes its own piece:

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
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor, distribute_tensor

from checkpoint_io import ddp_files, fsdp_files, zero_files
from checkpoint_io.whole_state import WholeState
from common.engine_names import DDP, DEEPSPEED, FSDP
from common.errors import UserError
from common.run_dir import DEEPSPEED_DIR, fsdp_optimizer_dir, rng_state_file
from model import GPT, GPTConfig
from model.pretrained import read_checkpoint, strip_wrapper_prefixes
from model.tensor_parallel import parallel_order
from model.unwrap import unwrapped
from training.checkpoints.resume import ResumePoint
from training.distributed.engines import Engine
from training.distributed.pipeline import PipelinedGPT
from training.optimizers.spec import OptimizerPlan


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


def read_whole(point: ResumePoint, config: GPTConfig, plan: OptimizerPlan) -> WholeState:
    """`point`'s weights and optimizer states, whole, on this process: the size of one DDP checkpoint."""
    _, weights = read_checkpoint(point.path)
    engine = Engine.of_record(point.engine)
    if engine.kind == FSDP:
        optimizers = [fsdp_files.read_optimizer(point.path / fsdp_optimizer_dir(i), config, engine.tensor_parallel)
                      for i in range(len(point.optimizers))]
    elif engine.kind == DEEPSPEED:
        optimizers = [zero_files.read_optimizer(point.path / DEEPSPEED_DIR)]
    else:
        optimizers = [ddp_files.read_optimizer(point.path, i, groups)[0]
                      for i, groups in enumerate(ddp_files.whole_groups(config, plan))]
    return WholeState(weights, optimizers)


def load_moved(point: ResumePoint, move: Move, config: GPTConfig, model: torch.nn.Module, optimizers: list,
               accelerator: Accelerator) -> None:
    """Load `point` into this rank's prepared `model` and `optimizers`, and its random stream where that carries over.
    Call on every rank."""
    if move.now.kind == DEEPSPEED:
        # One folder per checkpoint path, so a node's processes agree on it. The run folder's lock keeps any other
        # launch out of it.
        digest = hashlib.sha256(str(point.path.resolve()).encode()).hexdigest()[:16]
        scratch = Path(tempfile.gettempdir()) / f"gpt2-accelerate-moved-{digest}"
        zero_files.load_into(lambda: read_whole(point, config, move.plan), model, accelerator, scratch)
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
