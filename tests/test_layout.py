"""training/distributed/layout.py: the launch's parallel layout, one object that the run, the refusals, the header, the
checkpoint record and the memory planner read."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from common.errors import UserError
from planner import Launch
from training.distributed.engines import Engine
from training.distributed.layout import Layout
from training.distributed.machine import Machine


def test_the_degrees_multiply_to_the_world_tensor_parallel_innermost():
    layout = Layout(8, "fsdp", tensor_parallel=2)
    assert layout.data_parallel_size == 4
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.engine == Engine("fsdp", 0, 2) and layout.name == "FSDP2 x tensor parallel 2"
    assert Layout(3).data_parallel_size == 3 and Layout(3).name == "DDP"


def test_of_launch_reads_the_accelerate_environment(monkeypatch):
    monkeypatch.setattr(Machine, "this", classmethod(lambda cls: Machine(gpus=8, cores=16)))  # where ZeRO runs
    for name, value in {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert Layout.of_launch(1, world_size=4) == Layout(4, "deepspeed", 2)
    with pytest.raises(UserError, match="--tensor_parallel 2 is not supported under DeepSpeed ZeRO-2"):
        Layout.of_launch(2, world_size=4)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert Layout.of_launch(2, n_head=4, n_embd=64, world_size=4) == Layout(4, "fsdp", 0, 2)
    with pytest.raises(UserError, match="cannot split this model"):
        Layout.of_launch(2, n_head=3, n_embd=48, world_size=4)  # shapes given: from scratch


def test_running_takes_the_zero_stage_deepspeed_runs():
    accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                                  state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)))
    assert Layout(2, "deepspeed").running(accelerator) == Layout(2, "deepspeed", 3)


def test_the_planner_reads_the_same_layout():
    launch = Launch(4, processes=8, fsdp=True, tensor_parallel=2)
    assert launch.layout == Layout(8, "fsdp", 0, 2) and launch.data_parallel == 4
    assert Launch(4, processes=8, zero_stage=3).layout.engine == Engine("deepspeed", 3)
