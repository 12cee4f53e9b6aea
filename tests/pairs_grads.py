"""The gradient of one optimizer step on prompt/completion data, through the real `train_step`.

    accelerate launch ... tests/pairs_grads.py DATASET OUT_FILE MICRO_BATCH GRAD_ACCUM

Every rank builds the same tiny GPT and its own `PairsLoader`; the step runs SGD at lr 1 with no clipping,
so the weights move by exactly minus the step's gradient. The main process saves that move
({name: before - after}) to OUT_FILE (safetensors) for tests/test_pairs.py to compare.
"""
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.settings import DataConfig  # noqa: E402
from data.source import open_source  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from training.step import train_step  # noqa: E402

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=48, dropout=0.0)


def tiny_gpt() -> GPT:
    """The same initial weights in every process and in the test."""
    torch.manual_seed(0)
    return GPT(TINY)


def main(dataset: str, out_file: str, micro_batch: int, grad_accum: int) -> float:
    """Runs the step; returns the step's loss as train.py logs it (summed micro-batch losses / grad_accum,
    averaged over ranks)."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=grad_accum)
    loader = open_source(DataConfig(dataset=dataset)).train_loader(
        block_size=TINY.block_size, micro_batch_size=micro_batch, rank=accelerator.process_index,
        world_size=accelerator.num_processes, seed=0)
    model = tiny_gpt()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    loss_sum, _ = train_step(accelerator, model, [optimizer], loader.next_batch, grad_accum, lrs=[1.0], grad_clip=1e9,
                             masked_targets=loader.masked_targets)
    loss = accelerator.reduce(loss_sum / grad_accum, reduction="mean").item()
    if accelerator.is_main_process:
        after = dict(accelerator.unwrap_model(model).named_parameters())
        save_file({name: (before[name] - after[name].detach()).contiguous() for name in before}, out_file)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return loss


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
