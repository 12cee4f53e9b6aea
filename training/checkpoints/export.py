"""The end of a finished run: `final/`, the model as a Hugging Face GPT-2 folder. A LoRA run also writes
`final_adapter/`, the adapter as a PEFT folder; its `final/` holds the base with the adapter merged in."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch
from accelerate import Accelerator
from safetensors import SafetensorError

from checkpoint_io.weights import Weights
from checkpoint_io.whole_state import strip_wrapper_prefixes
from common.atomic import fresh_temp_dir, rename_into_place, write_failure
from common.errors import UserError
from common.parallelism import Parallelism
from common.run_dir import RunDir
from model import GPTConfig
from model.lora import has_adapters
from model.pretrained import save_state_dict
from model.tensor_parallel import reordered
from model.unwrap import unwrapped
from training.distributed.engines import full_state_dict
from training.distributed.pipeline import PipelinedGPT


def export_final(accelerator: Accelerator, model: torch.nn.Module, arch: GPTConfig, run: RunDir,
                 init_weights: Weights | None = None, parallelism: Parallelism | None = None) -> None:
    """Write `final/` atomically from the trained weights, then print where it is. Call on every rank.

    `init_weights` is the base a LoRA run's `final_adapter/` names. `parallelism` is the run's (None: not split): its
    tensor-parallel degree's head-group order of `c_attn` is undone, so `final/` has Hugging Face's layout whatever
    the degree."""
    module = unwrapped(model)
    if has_adapters(module):  # LoRA (DDP only): the adapter first, final/ last marks the end
        if accelerator.is_main_process:
            from model.lora import loadable_base, merged, save_adapter_folder

            base, revision = loadable_base(init_weights)
            _write(run, run.final_adapter, lambda tmp: save_adapter_folder(module, tmp, base, revision))
            _write(run, run.final, lambda tmp: merged(module).save_pretrained(tmp, overwrite=True))
            accelerator.print(f"final model (adapter merged) written to {run.final}, the adapter to "
                              f"{run.final_adapter}")
        return
    # The whole weights on the main process: gathered to the CPU under FSDP and ZeRO (DeepSpeed's fp32 master copy),
    # or from a pipeline's stages. They are written as they are: no second model holds a copy.
    state_dict = model.full_state_dict() if isinstance(model, PipelinedGPT) else full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        state_dict = reordered(strip_wrapper_prefixes(state_dict), arch.n_embd, parallelism or Parallelism(),
                               Parallelism())  # from the run's order of c_attn into Hugging Face's
        _write(run, run.final, lambda tmp: save_state_dict(state_dict, arch, tmp, overwrite=True))
        accelerator.print(f"final model written to {run.final}")


def _write(run: RunDir, folder: Path, write: Callable[[Path], None]) -> None:
    """Fill `folder` through a temporary one renamed into place; a full disk is one line."""
    tmp = fresh_temp_dir(folder)
    try:
        write(tmp)
        rename_into_place(tmp, folder)
    except (OSError, SafetensorError, RuntimeError) as err:
        if (reason := write_failure(err)) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"could not write {folder} ({reason}); the last checkpoint is intact: free disk space "
                        "and run again with --resume latest, which only writes final/") from None
