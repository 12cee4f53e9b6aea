"""The planner at the command line: `python train.py ... --plan`, and what `benchmarks.memory_plan` plans for.

`exit_after_plan` prints the plan of a run's resolved config and launch, then exits 0. The rest names the model
sizes and the device.
"""
from __future__ import annotations

import os

from common.errors import UserError
from model.config import SIZES, GPTConfig
from planner.advice import Spelling
from planner.launch import GB, Launch
from planner.memory import RunPhases, plan_memory
from planner.render import render
from training.distributed.layout import Layout
from training.distributed.machine import Asked, Machine, accelerate_runs_engines, trains_on
from training.distributed.processes import BatchGeometry
from training.network import scratch_architecture
from training.optimizers.plan import plan_optimizers

DEFAULT_DEVICE_GB = 80.0  # an H100 / A100 80 GB



def model_config(name: str, block_size: int | None = None) -> GPTConfig:
    """A named size (`gpt2` .. `gpt2-xl`, `tiny`, `mini`, `small`; `openai-community/gpt2-xl` too)."""
    short = name.split("/")[-1] if name.startswith("openai-community/") else name
    if short not in SIZES:
        raise UserError(f"model size {name!r} is not one the planner knows; choose one of {', '.join(SIZES)}")
    overrides = {} if block_size is None else {"block_size": block_size}
    try:
        return GPTConfig.from_name(short, **overrides)
    except ValueError as err:
        raise UserError(f"{err}") from None



def launch_environment(machine: Machine | None = None) -> dict[str, object]:
    """What `accelerate launch` tells the processes it starts, beside the layout: how many, and the precision.

    Also the device they train on, on `machine` (default: this one), as `machine.trains_on` rules. That is the CPU
    under a CPU launch (`--cpu`) and on a machine without a GPU, where accelerate puts them. An FSDP or DeepSpeed
    launch there trains nowhere (the run refuses it). It is planned as "cuda", for the GPUs it asks for."""
    env = os.environ
    asked = Asked.of_environment()
    return {"processes": asked.processes, "per_machine": asked.per_machine,
            "dtype": "bf16" if env.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16" else "fp32",
            "device": trains_on(asked, machine or Machine.this()) or "cuda", "cpu_asked": asked.cpu}



def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_here(device: str, processes_here: int = 1, why: str = "") -> tuple[int, str]:
    """The bytes per process a plan for a `device` ("cuda" or "cpu") launch is made against, and a line saying which.

    For "cuda": this machine's first GPU, else the default 80 GB. A GPU run is often planned on a machine without
    one, which has no size to read. For "cpu": this machine's memory, shared by the `processes_here` processes it
    runs. Issue 44: an 80 GB "device" told a 24 GB machine it had 69 GiB to spare. `why` says why the launch trains
    on the CPU. Issue 55: train.py --plan said "an 80 GB CUDA device" there, under cpu_2proc.yaml and without a GPU."""
    import torch

    if device == "cpu":
        total = machine_memory()
        share = f", {total / processes_here / GB:.1f} GB for each of its {processes_here} processes" \
            if processes_here > 1 else ""
        return total // processes_here, (f"  planned for this machine's memory: {total / GB:.1f} GB{share}"
                                         + (f" ({why})" if why else ""))
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties(0)
        return gpu.total_memory, f"  planned for cuda:0 of this machine: {gpu.name}, {gpu.total_memory / GB:.1f} GB"
    return int(DEFAULT_DEVICE_GB * GB), (
        f"  planned for an {DEFAULT_DEVICE_GB:g} GB CUDA device (an H100 / A100 80 GB), as this machine has none; for "
        "another size, python -m benchmarks.memory_plan --device cuda --device_memory GB (with --model, "
        "--micro_batch_size, --processes), or --plan on the machine that trains")


def exit_after_plan(cfg):
    """`python train.py ... --plan`: print the memory plan of this config and launch, then exit 0.

    The plan has every phase of the run (`plan_run`), and is made before anything is built. Without --plan, `cfg`
    comes back unchanged. The shapes come from the flags, or from `--init_from` when it names a GPT-2 size. The
    processes, engine and precision come from the accelerate launch's environment."""
    if not cfg.run.plan:
        return cfg
    model = cfg.model
    if model.from_scratch:
        config = scratch_architecture(model)
    elif model.init_from.split("/")[-1] in SIZES:
        config = model_config(model.init_from, model.block_size)
    else:
        raise UserError(f"--plan knows the shapes of GPT-2's sizes ({', '.join(list(SIZES)[:4])}), not of "
                        f"--init_from {model.init_from}; plan the same shape with --init_from scratch and its "
                        "--n_layer, --n_head, --n_embd")
    machine = Machine.this()
    env = launch_environment(machine)
    layout = Layout.of_launch(cfg.parallelism, config.n_head, config.n_embd,  # refused as a run would
                              world_size=int(env["processes"]), n_layer=config.n_layer)
    geometry = BatchGeometry.for_total(cfg.training.total_batch_size, cfg.training.micro_batch_size,
                                       config.block_size, layout.data_parallel_size)  # the run's rule
    launch = Launch(geometry.micro_batch_size, layout, activation_checkpointing=cfg.training.activation_checkpointing,
                    loss_chunk_rows=cfg.training.loss_chunk_rows,  # None: the launch's device's default
                    optimizer=plan_optimizers(cfg.optim, model, cfg.added).kind,  # auto resolved as a run does
                    dtype=str(env["dtype"]), accumulation=geometry.accumulation, device=str(env["device"]),
                    total_batch_size=cfg.training.total_batch_size,  # so that advised micro-batches divide it
                    grad_clip=cfg.training.grad_clip)
    if int(os.environ.get("RANK", "0")) == 0:
        # The CPU's memory is this machine's, shared by its processes; its advice names no engine it cannot run.
        why = ("the launch asks for the CPU" if env["cpu_asked"] else "this machine has no GPU: the run trains on "
               "the CPU; to plan a GPU run, python -m benchmarks.memory_plan --device cuda")
        device_bytes, which = device_here(launch.device, int(env["per_machine"]), why)
        run = RunPhases.of_flags(cfg.eval, cfg.added, hub_staging=cfg.hub.push_to_hub and cfg.hub.hub_push_every > 0)
        spelling = Spelling(fsdp="accelerate_configs/fsdp_8gpu.yaml (FSDP2)", processes="--num_processes",
                            sharding=launch.device == "cuda" or accelerate_runs_engines(machine))
        print(render(plan_memory(config, launch), device_bytes, spelling, run))
        print(which)
    raise SystemExit(0)
