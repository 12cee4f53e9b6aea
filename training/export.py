"""The end of a finished run: `final/`, the model as a Hugging Face GPT-2 folder."""
from __future__ import annotations

import torch
from accelerate import Accelerator

from common.atomic import fresh_temp_dir, publish
from common.run_dir import RunDir
from model import GPT, GPTConfig
from model.hf_io import strip_wrapper_prefixes


def export_final(accelerator: Accelerator, model: torch.nn.Module, arch: GPTConfig, run: RunDir) -> None:
    """Write `final/` from the trained weights (gathered from every rank under FSDP), atomically; call on every rank."""
    state_dict = strip_wrapper_prefixes(accelerator.get_state_dict(model))  # full weights on the main process
    if accelerator.is_main_process:
        export = GPT(arch)
        export.load_state_dict(state_dict)
        tmp = fresh_temp_dir(run.final)
        export.save_pretrained(tmp, overwrite=True)
        publish(tmp, run.final)
        accelerator.print(f"final model written to {run.final}")
