"""training/distributed/layout.py: the launch's parallel layout, one object that the run, the refusals, the header, the
checkpoint record and the memory planner read."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from common.engine_names import DDP, DEEPSPEED, FSDP
from common.errors import UserError
from common.parallelism import Parallelism
from configs.schema import parallelism_group
from planner import Launch, Shards
from training.distributed.layout import Layout
from training.distributed.machine import Machine


def test_the_degrees_multiply_to_the_world_tensor_parallel_innermost():
    """The launch's layout is one object (`training/distributed/layout.py`): the degrees multiply to the world with
    tensor parallelism innermost; it is read from the accelerate environment with the refusals
    (`test_of_launch_reads_the_accelerate_environment`); DeepSpeed's running stage is taken from its plugin
    (`test_running_takes_the_zero_stage_deepspeed_runs`); the planner's `Launch` holds the same layout.

    Seen to catch: not broken on purpose: new with the object, while the tensor-parallel and planner suites (50 tests)
    passed unchanged over it."""
    layout = Layout(8, Parallelism("fsdp", tensor_parallel=2))
    assert layout.data_parallel_size == 4
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.parallelism.name == "FSDP2 x tensor parallel 2" and layout.parallelism.model_parallel == 2
    assert Layout(3).data_parallel_size == 3 and Layout(3).parallelism.name == "DDP"


# What each engine answers (`Layout`'s questions), one row per launch: the sharded terms (parameters, gradients,
# optimizer state), full replicas, DeepSpeed's buckets, bf16 parameters, the fp32 master copy, DTensor matrices,
# pipelined; then the plan's words and the advised sharded engine.
ANSWERS = {
    Layout(1): ((0, 0, 0), 0, 0, 0, 0, 0, 0, "one process", "FSDP2"),
    Layout(8): ((0, 0, 0), 1, 0, 0, 0, 0, 0, "DDP", "FSDP2"),
    Layout(8, Parallelism(FSDP)): ((1, 1, 1), 0, 0, 1, 0, 1, 0, "FSDP2", "FSDP2"),
    Layout(8, Parallelism(FSDP, tensor_parallel=2)): ((1, 1, 1), 0, 0, 1, 0, 1, 0,
                                                      "FSDP2 over 4 x tensor parallel 2", "FSDP2 x tensor parallel 2"),
    Layout(8, Parallelism(DEEPSPEED, 1)): ((0, 0, 1), 0, 1, 1, 1, 0, 0, "DeepSpeed ZeRO-1", "DeepSpeed ZeRO-1"),
    Layout(8, Parallelism(DEEPSPEED, 2)): ((0, 1, 1), 0, 1, 1, 1, 0, 0, "DeepSpeed ZeRO-2", "DeepSpeed ZeRO-2"),
    Layout(8, Parallelism(DEEPSPEED, 3)): ((1, 1, 1), 0, 0, 1, 1, 0, 0, "DeepSpeed ZeRO-3", "DeepSpeed ZeRO-3"),
    Layout(1, Parallelism(DEEPSPEED, 2)): ((0, 1, 1), 0, 0, 1, 1, 0, 0, "DeepSpeed ZeRO-2", "DeepSpeed ZeRO-2"),
    Layout(8, Parallelism(pipeline_parallel=4)): ((0, 0, 0), 0, 0, 0, 0, 0, 1, "2 pipeline(s) of 4 stages (1F1B)",
                                                  "FSDP2 x pipeline 4"),
}


@pytest.mark.parametrize("layout", list(ANSWERS), ids=lambda layout: layout.parallelism.name)
def test_the_layout_answers_for_its_engine(layout):
    """What the planner and the header ask of an engine, answered by the layout (the engines' facts in one place).

    One row per engine (one process, DDP, FSDP2, FSDP2 x TP, ZeRO-1/2/3, ZeRO-2 alone, a pipeline): the sharded terms,
    full replicas, DeepSpeed's buckets, bf16 parameters, the fp32 master copy, DTensor matrices, pipelined, the plan's
    words, the sharded layout the advice moves to.

    Seen to catch: ZeRO-1 made to shard the gradients (`shards_gradients` from stage 1): the ZeRO-1 row fails."""
    asked = ((layout.shards_parameters, layout.shards_gradients, layout.shards_optimizer_state), layout.full_replicas,
             layout.reduces_in_buckets, layout.bf16_parameters, layout.fp32_master, layout.dtensor_matrices,
             layout.parallelism.pipelined, layout.describe(), layout.sharded().parallelism.name)
    assert asked == ANSWERS[layout]


def test_the_engine_words_are_composed_once():
    """The engine's name, the run header's words and the plan's end the same way (`Parallelism.degree_words`).

    E.g. `DEEPSPEED (ZeRO-3)`, `FSDP x tensor parallel 2`, `MULTI_GPU x pipeline 4 (1F1B; this stage: ...)`.

    Seen to catch: the degrees left out of `Engine.header_words` (now `Parallelism.header_words`): fails."""
    assert Parallelism(DEEPSPEED, 3).header_words("DEEPSPEED") == "DEEPSPEED (ZeRO-3)"
    assert Parallelism(FSDP, tensor_parallel=2).header_words("FSDP") == "FSDP x tensor parallel 2"
    assert Parallelism(pipeline_parallel=4).header_words("MULTI_GPU", "blocks 0-2 of 12") == \
        "MULTI_GPU x pipeline 4 (1F1B; this stage: blocks 0-2 of 12)"
    assert Parallelism(DDP).header_words("NO") == "NO"
    assert Layout(8, Parallelism(FSDP, tensor_parallel=2)).sharding_name == "FSDP2"
    assert Layout(8, Parallelism(DEEPSPEED, 3)).sharding_name == "ZeRO-3"


def test_a_layout_no_engine_runs_is_refused_in_one_line():
    """A layout no engine runs (a ZeRO stage under FSDP2, ZeRO-4, an unknown engine, a degree of 0) is refused in one
    line by `Layout.check`, which the planner's `Launch` calls too.

    Seen to catch: the ZeRO-stage-under-another-engine check removed: fails."""
    for layout, words in ((Layout(8, Parallelism(FSDP, 3)), "ZeRO stage 3 under FSDP"),
                          (Layout(8, Parallelism(DEEPSPEED, 4)), "ZeRO stage 4"),
                          (Layout(8, Parallelism("megatron")), "engine 'megatron'"),
                          (Layout(8, Parallelism(FSDP, tensor_parallel=0)), "--tensor_parallel must be positive")):
        with pytest.raises(UserError, match=words):
            layout.check()


def test_of_launch_reads_the_accelerate_environment(monkeypatch):
    monkeypatch.setattr(Machine, "this", classmethod(lambda cls: Machine(gpus=8, cores=16)))  # where ZeRO runs
    for name, value in {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}.items():
        monkeypatch.setenv(name, value)
    one, two = parallelism_group()(), parallelism_group()(tensor_parallel=2)  # the flags: --tensor_parallel 2
    assert Layout.of_launch(one, world_size=4) == Layout(4, Parallelism("deepspeed", 2))
    with pytest.raises(UserError, match="--tensor_parallel 2 is not supported under DeepSpeed ZeRO-2"):
        Layout.of_launch(two, world_size=4)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert Layout.of_launch(two, n_head=4, n_embd=64, world_size=4) == Layout(4, Parallelism("fsdp", tensor_parallel=2))
    with pytest.raises(UserError, match="cannot split this model"):
        Layout.of_launch(two, n_head=3, n_embd=48, world_size=4)  # shapes given: from scratch


def test_running_takes_the_zero_stage_deepspeed_runs():
    accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                                  state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)))
    assert Layout(2, Parallelism("deepspeed")).running(accelerator) == Layout(2, Parallelism("deepspeed", 3))


def test_the_planner_holds_the_run_layout():
    """The planner's `Launch` holds the run's `Layout`; what it shards over how many ranks is the layout's say.

    FSDP2 x TP 2 over 8 shards all three terms over the 4 data-parallel ranks; ZeRO-1 the optimizer state only.

    Seen to catch: `Shards.of` over the world size instead of the data-parallel ranks: fails."""
    layout = Layout(8, Parallelism(FSDP, tensor_parallel=2))
    launch = Launch(4, layout)
    assert launch.layout is layout and launch.shards == Shards(4, 4, 4)  # FSDP2 over the 4 data-parallel ranks
    assert Launch(4, Layout(8, Parallelism(DEEPSPEED, 1))).shards == Shards(1, 1, 8)
