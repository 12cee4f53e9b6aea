"""The network inside the wrappers of a run: torch.compile's OptimizedModule, DDP, FSDP1.

It is what accelerate's `extract_model_from_parallel` returns (`Accelerator.unwrap_model(model,
keep_torch_compile=False)`), without importing DeepSpeed where nothing uses it.

accelerate's unwrapping imports DeepSpeed whenever it is installed (`.[dev]`, `.[deepspeed]`), to recognise its
engine. DeepSpeed's first import prints `[WARNING] ... Setting accelerator to CPU` on every process of a machine
without a GPU. That was the first line of every run and CLI. A model can only be a DeepSpeed engine once DeepSpeed
is imported; a ZeRO run imports it when accelerate prepares the model. Until then the wrappers are torch's own.
Likewise FSDP1's: 1 s to import, for a CLI that never meets it.
"""
from __future__ import annotations

import sys

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """`model` without its compile and data-parallel wrappers (the network, or peft's model around it)."""
    if "deepspeed" in sys.modules:  # it may be a DeepSpeed engine: accelerate knows them all
        from accelerate.utils import extract_model_from_parallel

        return extract_model_from_parallel(model, keep_torch_compile=False)
    fsdp = sys.modules.get("torch.distributed.fsdp")
    wrappers = (DistributedDataParallel, DataParallel) + ((fsdp.FullyShardedDataParallel,) if fsdp else ())
    while True:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, wrappers):
            model = model.module
        else:
            return model
