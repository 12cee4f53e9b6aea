"""A step never waits for the device (training/step.py): between two logged steps the host reads no value of the
device, so on a GPU the next step is queued while this one runs.

Counted on a CPU, where nothing waits, by the operators that make the host wait on a GPU: `aten._local_scalar_dense`
(behind `.item()`, `float()`, `int()`, `bool()` of a tensor), `aten.equal`, `aten.is_nonzero`, `aten.nonzero`,
`aten.masked_select`. An optimizer's own step is left out: on a CPU torch's AdamW reads its step counter, which the
fused CUDA kernel keeps on the device.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import TINY, train_in_process
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

import train

aten = torch.ops.aten
SYNCS = {aten._local_scalar_dense, aten.equal, aten.is_nonzero, aten.nonzero, aten.masked_select}


class SyncCounter(TorchDispatchMode):
    """Counts the operators that read the device on the host, per optimizer step (a step's count runs from the
    start of its `train_step` to the start of the next: its update, its log line, evaluations and checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        self.step, self.paused, self.counts = 0, False, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.step and not self.paused and func.overloadpacket in SYNCS:
            self.counts[self.step] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """A counter around the run's steps: train.py's `train_step` starts each count; the optimizers' own steps are
    paused."""
    counter = SyncCounter()
    original = train.train_step

    def counting_step(*args, **kwargs):
        counter.step += 1
        return original(*args, **kwargs)

    def pause(*_):
        counter.paused = True

    def resume(*_):
        counter.paused = False

    monkeypatch.setattr(train, "train_step", counting_step)
    handles = [register_optimizer_step_pre_hook(pause),
               register_optimizer_step_post_hook(resume)]
    with counter:
        yield counter
    for handle in handles:
        handle.remove()


RUN = TINY + ["--max_steps", "6", "--micro_batch_size", "2", "--total_batch_size", "128", "--log_every", "3",
              "--eval_every", "6", "--save_every", "6"]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_step_that_shows_nothing_reads_nothing_from_the_device(counted, tmp_path, optimizer):
    train_in_process(RUN + ["--optimizer", optimizer, "--out_dir", str(tmp_path / "run")])
    assert counted.step == 6
    quiet = [1, 2, 4, 5]  # steps 3 and 6 log; 6 also evaluates and saves
    assert {step: counted.counts[step] for step in quiet} == dict.fromkeys(quiet, 0)
    assert counted.counts[3] > 0  # a logged step reads its loss and norm: the counter sees a read


@pytest.mark.slow
def test_a_deliberate_read_in_the_step_is_counted(counted, tmp_path, monkeypatch):
    """The counter catches what it is there for: an `.item()` inside the step."""
    import training.step

    original = training.step.to_device

    def reading(batch, device):
        batch.sum().item()
        return original(batch, device)

    monkeypatch.setattr(training.step, "to_device", reading)
    train_in_process(RUN + ["--max_steps", "2", "--out_dir", str(tmp_path / "run")])
    assert counted.counts[1] > 0
