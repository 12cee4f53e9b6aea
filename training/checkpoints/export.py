"""The end of a finished run: `final/`, the model as a Hugging Face GPT-2 folder. A LoRA run also writes
`final_adapter/`, the adapter as a PEFT folder; its `final/` holds the base with the adapter merged in."""
from __future__ import annotations

import os
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
from common.run_dir import RunDir
from eval.hellaswag_data import SAMPLE_FILE
from model import GPTConfig
from model.lora import has_adapters
from model.pretrained import save_state_dict
from model.tensor_parallel import natural_order
from model.unwrap import unwrapped
from training.distributed.engines import full_state_dict
from training.distributed.pipeline import PipelinedGPT


def export_final(accelerator: Accelerator, model: torch.nn.Module, arch: GPTConfig, run: RunDir,
                 last_val: tuple[int, float] | None = None, init_weights: Weights | None = None,
                 tensor_parallel: int = 1, hellaswag_data: str | None = None) -> None:
    """Write `final/` atomically from the trained weights, then print where it is, the last validation loss
    (`last_val`: step, loss) and what to run next. Call on every rank.

    `init_weights` is the base a LoRA run's `final_adapter/` names. `hellaswag_data` is the run's HellaSwag file, if
    any, for the suggested command. `tensor_parallel` is the run's degree, whose head-group order of `c_attn` is
    undone: `final/` has Hugging Face's layout whatever the degree."""
    module = unwrapped(model)
    if has_adapters(module):  # LoRA (DDP only): the adapter first, final/ last marks the end
        if accelerator.is_main_process:
            from model.lora import loadable_base, merged, save_adapter_folder

            base, revision = loadable_base(init_weights)
            _write(run, run.final_adapter, lambda tmp: save_adapter_folder(module, tmp, base, revision))
            _write(run, run.final, lambda tmp: merged(module).save_pretrained(tmp, overwrite=True))
            accelerator.print(f"final model (adapter merged) written to {run.final}, the adapter to "
                              f"{run.final_adapter}")
            accelerator.print(next_steps(run, last_val, hellaswag_data))
        return
    # The whole weights on the main process: gathered to the CPU under FSDP and ZeRO (DeepSpeed's fp32 master copy),
    # or from a pipeline's stages. They are written as they are: no second model holds a copy.
    state_dict = model.full_state_dict() if isinstance(model, PipelinedGPT) else full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        state_dict = natural_order(strip_wrapper_prefixes(state_dict), arch.n_embd, tensor_parallel)
        _write(run, run.final, lambda tmp: save_state_dict(state_dict, arch, tmp, overwrite=True))
        accelerator.print(f"final model written to {run.final}")
        accelerator.print(next_steps(run, last_val, hellaswag_data))


def next_steps(run: RunDir, last_val: tuple[int, float] | None, hellaswag_data: str | None = None) -> str:
    """The run's last line but one: its validation loss and the commands to run next. Each runs as written, offline
    too: HellaSwag reads the run's `--hellaswag_data`, else the items the repository ships, not the Hub."""
    result = f"validation loss {last_val[1]:.4f} at step {last_val[0]}; " if last_val else ""
    if hellaswag_data:
        hellaswag = f"--data {hellaswag_data}"
    else:
        shown = os.path.relpath(SAMPLE_FILE)
        items = len(SAMPLE_FILE.read_text().splitlines())
        hellaswag = (f"--data {SAMPLE_FILE if shown.startswith('..') else shown} ({items} shipped items, a try; "
                     "without --data, the Hub's validation set)")
    return (f"{result}next: python -m model.sample --model {run.path} --prompt \"...\", python -m eval.hellaswag "
            f"--model {run.path} {hellaswag}, python -m publish.hub --run_dir {run.path} --hub_model_id <user>/<name>")


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
