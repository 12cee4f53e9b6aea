"""training/distributed/support.py: the one table of what runs under which engine. The refusals train.py makes before a
run
(`refuse_unsupported`, `Layout.check`) and the memory planner's (`Launch`) agree with it cell by cell, and
the README and docs/engines.md show it as it is."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType
from conftest import REPO_ROOT

from common.engine_names import DEEPSPEED, FSDP
from common.errors import UserError
from common.parallelism import PIPELINE, TENSOR, Parallelism, columns
from planner import Launch
from training.distributed.engines import refuse_unsupported
from training.distributed.layout import Layout
from training.distributed.support import support, support_table

SUPPORT = support()  # the optimizers' rows, declared by their modules, and the rest

# Each column as train.py's Parallelism.
ENGINES = {"DDP": Parallelism("ddp"), "FSDP2": Parallelism("fsdp"), "ZeRO-1": Parallelism("deepspeed", 1),
           "ZeRO-2": Parallelism("deepspeed", 2), "ZeRO-3": Parallelism("deepspeed", 3),
           "FSDP2 x TP": Parallelism("fsdp", tensor_parallel=2), "DDP x PP": Parallelism("ddp", pipeline_parallel=2)}


def accelerator_of(engine: Parallelism) -> SimpleNamespace:
    """What refuse_unsupported reads of an Accelerator: an empty DeepSpeed config, accelerate's AC off."""
    kind = {"deepspeed": DistributedType.DEEPSPEED, "fsdp": DistributedType.FSDP}.get(engine.kind,
                                                                                      DistributedType.MULTI_CPU)
    return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(
        deepspeed_plugin=SimpleNamespace(deepspeed_config={}, zero_stage=engine.zero_stage),
        fsdp_plugin=SimpleNamespace(activation_checkpointing=False)))


def refused_at_run_time(feature: str, engine: Parallelism, grad_clip: float = 1.0) -> str | None:
    """The line train.py refuses `feature` with under `engine` (at `--grad_clip`), or None when it goes on."""
    try:
        if feature in (TENSOR.flag, PIPELINE.flag):  # a degree of 2 on top of the column's
            Layout(4, engine.with_sizes(**{feature.removeprefix("--"): 2})).check()
        else:
            optimizer = feature.split()[1] if feature.startswith("--optimizer") else "adamw"
            refuse_unsupported(engine, accelerator_of(engine), optimizer,
                               feature == "--lora_rank", "skip" if feature == "--on_nan skip" else "stop", False,
                               grad_clip)
    except UserError as err:
        return str(err)
    return None


def test_the_columns_are_the_engines():
    assert list(ENGINES) == list(columns())
    assert [e.column for e in ENGINES.values()] == list(columns())
    assert [e.name for e in ENGINES.values()] == ["DDP", "FSDP2", "DeepSpeed ZeRO-1", "DeepSpeed ZeRO-2",
                                                  "DeepSpeed ZeRO-3", "FSDP2 x tensor parallel 2", "DDP x pipeline 2"]
    assert Parallelism("deepspeed").name == "DeepSpeed"  # a config whose stage is not read yet


@pytest.mark.parametrize("feature", list(SUPPORT))
def test_the_run_refuses_exactly_what_the_table_says(feature):
    """One table says what runs under which engine (`training/distributed/support.py`: its rows and each registered
    optimizer's cells). train.py's refusals (`refuse_unsupported`, `Layout.check`) refuse exactly its refused cells,
    each in one line with the cell's fix; the planner refuses Muon where it does
    (`test_the_planner_refuses_muon_where_the_table_does`); the columns are the engines
    (`test_the_columns_are_the_engines`). A refusal lifted by a setting (`Refusal.unless`): Muon's ZeRO cells read "runs
    with `--grad_clip 0`"; the run refuses them at `--grad_clip 1` with the fix named and runs them at 0, the planner
    likewise.

    Seen to catch: a refusal written beside the table in `refuse_unsupported` (LoRA under DDP): fails. The `unless`
    cases are the table's own tests, extended, not broken on purpose."""
    for name, engine in ENGINES.items():
        line = refused_at_run_time(feature, engine)
        if (feature, name) in (("--tensor_parallel", "FSDP2 x TP"), ("--pipeline_parallel", "DDP x PP")):
            continue  # the column is the feature itself
        assert (line is not None) == (name in SUPPORT[feature]), (feature, name, line)
        if line is not None:
            assert line.startswith(feature.split()[0]) and SUPPORT[feature][name].fix in line and "\n" not in line
        unless = SUPPORT[feature][name].unless if name in SUPPORT[feature] else None
        if unless is not None:  # a cell that runs with a setting (Muon under ZeRO with --grad_clip 0): it does
            assert unless == "--grad_clip 0" and unless in line
            assert refused_at_run_time(feature, engine, grad_clip=0.0) is None, (feature, name)


def test_the_planner_refuses_muon_where_the_table_does():
    launches = {"DDP": Launch(1, Layout(8)), "FSDP2": Launch(1, Layout(8, Parallelism(FSDP))),
                **{f"ZeRO-{s}": Launch(1, Layout(8, Parallelism(DEEPSPEED, s))) for s in (1, 2, 3)},
                "FSDP2 x TP": Launch(1, Layout(8, Parallelism(FSDP, tensor_parallel=2)))}
    for name, launch in launches.items():
        cell = SUPPORT.get("--optimizer muon", {}).get(name)
        if cell is not None:
            with pytest.raises(UserError, match="--optimizer muon is not supported"):
                Launch(1, launch.layout, optimizer="muon")
        else:
            Launch(1, launch.layout, optimizer="muon")
        if cell is not None and cell.unless == "--grad_clip 0":  # the run's clipping, as train.py --plan passes it
            Launch(1, launch.layout, optimizer="muon", grad_clip=0.0)


@pytest.mark.parametrize("page", ["README.md", "docs/engines.md"])
def test_the_readme_shows_the_table(page):
    """The README's engines table and docs/engines.md's, each rendered exactly as support_table() renders it.

    Seen to catch: a cell changed (`--on_nan skip` runs under ZeRO-2): fails. Not planted: the table moved into
    engines.md without its `--pipeline_parallel` row (issue 55's move), and `[docs/engines.md]` failed until the row was
    put back."""
    assert support_table() in (REPO_ROOT / page).read_text()


def test_the_table_says_what_muon_costs_where_it_runs_sharded():
    """Muon's cells under FSDP2 and tensor parallelism name the all-gather per matrix (its module declares them);
    under DDP and the pipeline every rank holds its matrices whole: plain "runs"; under ZeRO it runs with clipping off
    only, as DeepSpeed's own Muon (a refusal that hangs on --grad_clip: `Refusal.unless`).

    The README shows the table as generated (`test_the_readme_shows_the_table`).

    Seen to catch: `support_table` without the cost notes: both fail."""
    muon_row = next(line for line in support_table().splitlines() if line.startswith("| `--optimizer muon` |"))
    cells = dict(zip(columns(), [c.strip() for c in muon_row.split("|")[2:-1]]))
    assert cells["FSDP2"] == cells["FSDP2 x TP"] == "runs (each matrix all-gathered a step)"
    assert cells["DDP"] == cells["DDP x PP"] == "runs"
    assert cells["ZeRO-1"] == cells["ZeRO-2"] == cells["ZeRO-3"] == "runs with `--grad_clip 0` (DeepSpeed's own Muon)"
    lora_row = next(line for line in support_table().splitlines() if line.startswith("| `--lora_rank` |"))
    assert "| refused |" in lora_row  # a refusal with no setting that lifts it, and no cost shown
