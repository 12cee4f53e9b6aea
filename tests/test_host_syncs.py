"""A step never waits for the device (training/step.py): between two logged steps the host reads no value of the
device, so on a GPU the next step is queued while this one runs.

Counted on a CPU, where nothing waits, by the operators that make the host wait on a GPU: `aten._local_scalar_dense`
(behind `.item()`, `float()`, `int()`, `bool()` of a tensor), `aten.equal`, `aten.is_nonzero`, `aten.nonzero`,
`aten.masked_select`. An optimizer's own step is left out: on a CPU torch's AdamW reads its step counter, which the
fused CUDA kernel keeps on the device.
"""
from __future__ import annotations

import pytest
from conftest import TINY, train_in_process
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import training.step
from benchmarks.step_probe import SyncCounter


@pytest.fixture
def counted(monkeypatch):
    """The sweep's counter (benchmarks/step_probe.py) around a whole run, read at the start of each of train.py's
    steps: `counts[k]` is what step k read, from the start of its `train_step` to the next one's (its update, its
    log line, its evaluations and checkpoint). The optimizers' own steps are counted apart."""
    counter, totals = SyncCounter(), [0]
    original = training.step.train_step  # train.py's train() imports it from there when the run starts

    def outside_optimizers() -> int:
        return sum(n for (section, _), n in counter.counts.items() if section != "optimizer")

    def counting_step(*args, **kwargs):
        totals.append(outside_optimizers())
        return original(*args, **kwargs)

    monkeypatch.setattr(training.step, "train_step", counting_step)
    handles = [register_optimizer_step_pre_hook(lambda *_: setattr(counter, "section", "optimizer")),
               register_optimizer_step_post_hook(lambda *_: setattr(counter, "section", "step"))]
    with counter:
        yield lambda: [b - a for a, b in zip(totals[1:], totals[2:] + [outside_optimizers()])]
    for handle in handles:
        handle.remove()


RUN = TINY + ["--max_steps", "6", "--micro_batch_size", "2", "--total_batch_size", "128", "--log_every", "3",
              "--eval_every", "6", "--save_every", "6"]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_step_that_shows_nothing_reads_nothing_from_the_device(counted, tmp_path, optimizer):
    """A step never waits for the device: from one `train_step` to the next, a step that shows nothing (no log line,
    evaluation or checkpoint) reads no device value on the host, with AdamW and with Muon; a logged step does read. The
    counter is the sweep's dispatch counter (`_local_scalar_dense`, `equal`, `is_nonzero`, `nonzero`, `masked_select`),
    the optimizers' own steps left out.

    Seen to catch: before the change, a quiet step read once (the data flag's `.item()`): `{1: 1} != {1: 0}`."""
    train_in_process(RUN + ["--optimizer", optimizer, "--out_dir", str(tmp_path / "run")])
    reads = counted()
    assert len(reads) == 6
    assert [reads[k - 1] for k in (1, 2, 4, 5)] == [0, 0, 0, 0]  # steps 3 and 6 log; 6 also evaluates and saves
    assert reads[2] > 0  # a logged step reads its loss and norm: the counter sees a read


@pytest.mark.slow
def test_a_deliberate_read_in_the_step_is_counted(counted, tmp_path, monkeypatch):
    """The counter catches what it is there for: an `.item()` inside the step.

    Seen to catch: this test is the break itself."""
    original = training.step.to_device

    def reading(batch, device):
        batch.sum().item()
        return original(batch, device)

    monkeypatch.setattr(training.step, "to_device", reading)
    train_in_process(RUN + ["--max_steps", "2", "--out_dir", str(tmp_path / "run")])
    assert counted()[0] > 0
