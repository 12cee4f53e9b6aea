"""Helpers shared by the evaluations: ranks, exact cross-rank collectives, devices, model loading,
and the Accelerator of a command-line run."""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch

from checkpoint_io.weights import Weights
from common.errors import UserError
from common.launch import grouped_on_this_cpu, launched_processes, leftover_group_variables
from data.tokenizer import require_known_ids
from model.unwrap import unwrapped


def rank_and_world(accelerator: Any | None) -> tuple[int, int]:
    """(process_index, num_processes) of an Accelerator, or (0, 1) without one."""
    if accelerator is None:
        return 0, 1
    return accelerator.process_index, accelerator.num_processes


def steps_per_rank(n: int, world: int, per_step: int) -> int:
    """Forward passes every rank runs when n units are dealt round-robin (i % world == rank).

    The same on every rank (rank 0 holds the most units), so FSDP's collectives line up; ranks
    with fewer units run padding batches that count zero.
    """
    return math.ceil(math.ceil(n / world) / per_step) if n else 0


def reduce_sum(values: torch.Tensor, accelerator: Any | None) -> torch.Tensor:
    """Sum a 1-D tensor of totals over ranks (int64 counts stay exact) and return it on the CPU."""
    if accelerator is not None and accelerator.num_processes > 1:
        values = accelerator.reduce(values.to(accelerator.device), reduction="sum")
    return values.cpu()


def gather_rows(values: torch.Tensor, accelerator: Any | None) -> torch.Tensor:
    """Every rank's `values` concatenated along dim 0 in rank order, on the CPU, on every rank.

    All ranks must pass the same shape and dtype (pad to a common row count first); the values
    are copied, not converted, so float64 log-likelihoods and int64 counts arrive bit-exact.
    """
    if accelerator is not None and accelerator.num_processes > 1:
        values = accelerator.gather(values.to(accelerator.device))
    return values.cpu()


def broadcast_from_main(values: torch.Tensor, accelerator: Any | None) -> torch.Tensor:
    """The main process's `values` on every rank (bit-exact), on the CPU.

    Other ranks pass a tensor of the same shape and dtype, whose contents are ignored.
    """
    if accelerator is not None and accelerator.num_processes > 1:
        # Imported here: single-process callers need no accelerate.
        from accelerate.utils import broadcast

        values = broadcast(values.to(accelerator.device), from_process=0)
    return values.cpu()


@contextlib.contextmanager
def cli_accelerator(cpu: bool, command: str) -> Iterator[Any]:
    """The Accelerator of a command-line run (`command`, e.g. "python -m eval.hellaswag"), ended in order.

    Under `accelerate launch` of several processes the ranks form one group and split the work, on this CPU over
    gloo where the machine has no CUDA (`common.launch`: the rule train.py runs under; accelerate's launcher never
    passes `use_cpu` to them). A launch whose ranks still come up alone, which would each evaluate everything and
    write the same `--output`, is one line naming the plain command. On success every rank waits at a barrier,
    so none tears the process group down while another still uses it; then, success or not, `end_training`
    destroys the group: a process that exits with it open can abort at interpreter exit ("terminate called
    without an active exception").
    """
    from accelerate import Accelerator

    if (leftover := leftover_group_variables(command)) is not None:
        raise UserError(leftover)
    accelerator = Accelerator(cpu=cpu or grouped_on_this_cpu())
    if accelerator.num_processes != launched_processes():
        raise UserError(f"this launch started {launched_processes()} processes but accelerate brought up "
                        f"{accelerator.num_processes} as a group, so each would evaluate everything alone and write "
                        f"the same output; run `{command}` with the same flags as one process, without accelerate "
                        "launch", on_every_rank=True)
    try:
        yield accelerator
        accelerator.wait_for_everyone()
    finally:
        accelerator.end_training()


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (where its inputs must go)."""
    return next(model.parameters()).device


def model_block_size(model: torch.nn.Module) -> int | None:
    """The context length of our GPT (or an HF model), looking through DDP/FSDP/compile wrappers."""
    config = getattr(unwrapped(model), "config", None)
    return getattr(config, "block_size", None) or getattr(config, "n_positions", None)


def model_vocab_size(model: torch.nn.Module) -> int:
    """The number of token ids our GPT (or an HF model) knows, looking through DDP/FSDP/compile wrappers."""
    return unwrapped(model).config.vocab_size


def require_known_tokens(model: torch.nn.Module, max_id: int, tokens: str, accelerator: Any | None = None) -> None:
    """`data.tokenizer.require_known_ids` for the tokens an evaluation feeds `model`, whose largest id on this rank is
    `max_id`: the ranks take the largest of theirs first (a collective: call on every rank), so that all refuse
    alike, with one line printed."""
    if accelerator is not None and accelerator.num_processes > 1:
        max_id = int(gather_rows(torch.tensor([max_id], dtype=torch.int64), accelerator).max())
    try:
        require_known_ids(max_id, model_vocab_size(model), tokens, "the model")
    except UserError as err:
        err.on_every_rank = True
        raise


def autocast(device: torch.device, bf16: bool | None) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA by default (bf16=None); fp32 elsewhere or when bf16 is False."""
    enabled = device.type == "cuda" if bf16 is None else bf16
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Evaluate without dropout and without gradients, then put the model back as it was."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def load_model(weights: str | Weights, device: torch.device) -> torch.nn.Module:
    """`GPT.from_pretrained(weights)` (a spec: Hub id, HF folder, our checkpoint or run folder; or resolved
    `Weights`) on `device`."""
    from model import GPT

    return GPT.from_pretrained(weights).to(device)


def pick_device(name: str | None, accelerator: Any) -> torch.device:
    """`--device` if given on a single process, else the accelerator's device (one GPU per rank)."""
    if name and accelerator.num_processes == 1:
        try:
            return torch.device(name)
        except RuntimeError as err:
            raise UserError(f"bad --device {name!r} ({err}); use cpu, cuda, cuda:1, mps") from err
    return accelerator.device
