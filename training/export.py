"""The end of a finished run: `final/`, the model as a Hugging Face GPT-2 folder."""
from __future__ import annotations

import shutil

import torch
from accelerate import Accelerator
from safetensors import SafetensorError

from common.atomic import fresh_temp_dir, publish
from common.errors import UserError
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
        try:
            export.save_pretrained(tmp, overwrite=True)
            publish(tmp, run.final)
        except (OSError, SafetensorError) as err:
            shutil.rmtree(tmp, ignore_errors=True)
            reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
            raise UserError(f"could not write {run.final} ({reason}); the last checkpoint is intact: free disk space "
                            "and run again with --resume latest, which only writes final/") from None
        accelerator.print(f"final model written to {run.final}")
