"""Test-only: lets accelerate run a DeepSpeed or FSDP launch on a machine without an accelerator, on gloo.
Never imported by the product; tests/fault_train.py installs it when ENGINE_SHIM=1.

What accelerate 1.15 does with such a launch on a CPU, as shipped (../shared/notes/engines-on-cpu.md): its backend
choice (`PartialState._prepare_backend`) finds no device, so every rank comes up alone (backend None, world size
1); a DeepSpeed launch then fails DeepSpeed's batch check, an FSDP launch trains the whole batch on each rank.
With `cpu=True` (ACCELERATE_USE_CPU) it runs plain DDP instead. train.py refuses all three in one line
(`training.distributed.engines`); this shim changes just the two decisions that stand between a CPU and the engine:

1. the backend: a launched rank (LOCAL_RANK set) of a DeepSpeed or FSDP launch for which accelerate found none gets
   gloo on the CPU (DeepSpeed's own CPU accelerator would ask for oneCCL, absent here);
2. FSDP: accelerate counts only accelerator devices as FSDP-capable, so after `AcceleratorState` is built the
   launch's FSDP plugin is put back in place (DeepSpeed needs nothing: accelerate keeps it for any `cpu=False`
   launch).

train.py refuses an engine launch on a machine without a GPU before anything is built
(`training.distributed.machine.accelerate_runs_engines`); the shim, which makes accelerate run it, answers yes there.

It also skips DeepSpeed's shared-memory collective op, which its CPU backend otherwise compiles with g++ at the
first start (minutes; CI has no use for it: gloo does the collectives). The tests then prove each engine is really
in use from what it leaves behind (sharded parameters or optimizer state), since accelerate falls back silently.

The shim reaches into accelerate's and DeepSpeed's internals, so it is tied to the versions it was written and
measured for: any other (major, minor) version stops the run with an error naming both, instead of a run that
silently trains something else.
"""
from __future__ import annotations

import importlib
import os
from importlib.metadata import version

WRITTEN_FOR = {"accelerate": (1, 15), "deepspeed": (0, 19)}


def _check_versions() -> None:
    for package, expected in WRITTEN_FOR.items():
        found = tuple(int(part) for part in version(package).split(".")[:2])
        if found != expected:
            raise RuntimeError(
                f"tests/engine_shim.py was written for {package} {expected[0]}.{expected[1]}.x, found "
                f"{version(package)}: "
                "read the new version's PartialState._prepare_backend / AcceleratorState.__init__ (accelerate) or "
                "deepspeed.comm.torch.build_shm_op, update the shim and WRITTEN_FOR")


def _engine_launch() -> str | None:
    """'deepspeed' or 'fsdp' when this process is a rank of such an `accelerate launch`, else None."""
    if int(os.environ.get("LOCAL_RANK", -1)) == -1:
        return None
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "deepspeed"
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "fsdp"
    return None


def install() -> None:
    _check_versions()
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    prepare_backend = PartialState._prepare_backend

    def gloo_for_engine_launches(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, distributed_type = prepare_backend(self, cpu, sagemaker_dp, backend)
        if chosen is None and _engine_launch() is not None:
            return "gloo", DistributedType.MULTI_CPU
        return chosen, distributed_type

    PartialState._prepare_backend = gloo_for_engine_launches

    import training.distributed.machine

    training.distributed.machine.accelerate_runs_engines = lambda machine: True  # accelerate now runs the engines here

    accelerator_state_init = AcceleratorState.__init__

    def keep_fsdp(self, *args, fsdp_plugin=None, cpu=False, **kwargs):
        accelerator_state_init(self, *args, fsdp_plugin=fsdp_plugin, cpu=cpu, **kwargs)
        # What a GPU machine does: FSDP for an FSDP launch, unless the CPU was asked for (use_cpu), which is DDP.
        asked_for_cpu = cpu or os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")
        if (_engine_launch() == "fsdp" and fsdp_plugin is not None and not asked_for_cpu
                and self.distributed_type == DistributedType.MULTI_CPU):
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = keep_fsdp

    # `deepspeed.comm.torch` as an attribute is the torch package (deepspeed.comm imports it): take the module itself.
    ds_torch_backend = importlib.import_module("deepspeed.comm.torch")
    ds_torch_backend.build_shm_op = lambda: None  # gloo does the collectives; no g++ build at the first start


def _local_numel(tensor) -> int:
    """Elements this rank holds: a ZeRO-3 partition (`ds_tensor`), an FSDP2 shard (DTensor), or the tensor."""
    if hasattr(tensor, "ds_tensor"):
        return tensor.ds_tensor.numel()
    if hasattr(tensor, "to_local"):
        return tensor.to_local().numel()
    return tensor.numel()


def _whole_numel(tensor) -> int:
    if hasattr(tensor, "ds_numel"):
        return tensor.ds_numel
    return tensor.full_tensor().numel() if hasattr(tensor, "full_tensor") else tensor.numel()


def _torch_optimizer(optimizer):
    """The torch optimizer under accelerate's and DeepSpeed's wrappers (each keeps the one it wraps as .optimizer)."""
    while not type(optimizer).__module__.startswith("torch.optim"):
        optimizer = optimizer.optimizer
    return optimizer


def probe_shards(folder: str) -> None:
    """Before each `save_state`, write what this rank holds to `folder`/rank{r}.json: its parameters' elements
    (local and whole), its AdamW first moments' elements and each parameter's local shape, the evidence that an
    engine really shards (and how: tensor parallelism splits the blocks' matrices along rows or columns)."""
    import json
    from pathlib import Path

    from accelerate import Accelerator

    save_state = Accelerator.save_state

    def save_state_probed(self, *args, **kwargs):
        module = self.unwrap_model(self._models[0], keep_torch_compile=False)
        params = list(module.parameters())
        moments = [s["exp_avg"] for s in _torch_optimizer(self._optimizers[0]).state.values() if "exp_avg" in s]
        report = {"engine": self.distributed_type.value, "world": self.num_processes,
                  "params_whole": sum(_whole_numel(p) for p in params),
                  "params_local": sum(_local_numel(p) for p in params),
                  "moments_local": sum(_local_numel(m) for m in moments),
                  "local_shapes": {name: list(p.to_local().shape if hasattr(p, "to_local") else p.shape)
                                   for name, p in module.named_parameters()}}
        Path(folder, f"rank{self.process_index}.json").write_text(json.dumps(report))
        return save_state(self, *args, **kwargs)

    Accelerator.save_state = save_state_probed
