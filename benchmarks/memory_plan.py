"""The memory planner: what one training process needs, per device, computed from the model's shapes.

    python -m benchmarks.memory_plan --model gpt2-xl --micro_batch_size 4 --block_size 1024 --processes 8 \
        [--fsdp | --zero 1|2|3] [--activation_checkpointing] [--optimizer muon|adamw] [--dtype bf16] \
        [--loss_chunk_rows 0|N] [--device_memory 80]
    python -m benchmarks.memory_plan --validate          # planned vs measured peak RSS on this CPU, 3+ shapes
    python -m benchmarks.memory_plan --table             # docs/engines.md's "what fits where" table (computed)
    python -m benchmarks.memory_plan --check --device cuda --model gpt2 --micro_batch_size 16   # one shape, GPU

It prints each phase of the run (the training step, validation, HellaSwag with --hellaswag, a checkpoint save, the
export, the Hub staging of checkpoints with --hub_push_every), what the largest holds (parameters, gradients,
optimizer state, activations per layer, the loss, ...) against the device, and whether the run fits; when it does
not, one line names the phase that decides and the setting that lowers it (exit status 1).
The arithmetic is `planner` (train.py's `--plan` prints the same table for a run's config).

`--measure` (what `--validate` runs, each shape in its own subprocess so its ru_maxrss is its own) builds the
model on the CPU and runs two steps (forward, backward, AdamW step, zero_grad(set_to_none=True)) in fp32 and
prints the peak RSS; `--device cuda --measure` does the same on a GPU with bf16 autocast and prints
torch.cuda.max_memory_allocated (the GPU acceptance run's memory_plan stage).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

from common.cli import CliParser
from common.engine_names import DDP, DEEPSPEED, FSDP
from common.errors import UserError, run_cli
from common.parallelism import Parallelism
from model.config import SIZES
from model.loss import describe_loss_path
from planner import (
    CPU_PROCESS_BYTES,
    DEFAULT_DEVICE_GB,
    DEVICES,
    DTYPES,
    GB,
    OPTIMIZERS,
    GiB,
    Launch,
    RunPhases,
    largest_micro_batch,
    machine_memory,
    model_config,
    plan_memory,
    render,
    run_advice,
)
from training.distributed.layout import Layout

# glibc returns a freed block to the system only when it was mmapped, and raises its mmap threshold (up to 32 MB)
# each time it frees one: from the second step on, most tensors live on the heap, whose freed pages stay in the
# RSS. A fixed threshold keeps every tensor above 64 KiB mmapped, so the peak RSS is the peak of the bytes the
# tensors hold (what torch.cuda.max_memory_allocated is on a GPU): the planner's quantity. --validate shows both.
MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}

# The shapes --validate measures: (model, micro-batch, block size). Each takes under two minutes on 2 cores.
# small 64 x 256 is where activation checkpointing matters (its activations are 2.4 GiB without it, 0.6 with it).
VALIDATION_SHAPES = [("mini", 8, 128), ("small", 8, 256), ("small", 64, 256), ("gpt2", 1, 1024), ("gpt2", 4, 1024)]
TOLERANCE = 0.15  # planned vs measured, the bound
TABLE_MODELS = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]
TABLE_CAP = 256  # micro-batches above this are shown as "256+"


def rss_bytes() -> int:
    """This process's peak RSS: VmHWM, the high-water mark of its own address space. Not ru_maxrss: Linux carries
    the parent's peak over an exec into it (so a child of a large pytest process would report the parent's)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure(model: str, micro_batch_size: int, block_size: int, device: str, checkpointing: bool,
            loss_chunk_rows: int | None = None) -> dict:
    """Two training steps of `model` (fp32 on the CPU, bf16 autocast on CUDA), the loss on `loss_chunk_rows`'s path
    (None: the device's default); the peak memory they reached."""
    import torch

    from model import GPT, GPTConfig

    # The process's own share: Python, torch, and what the first step's kernels set up (thread pools, BLAS
    # workspaces: ~0.09 GiB on this CPU), measured after one step of a 1-layer, 8-wide model.
    warm = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=64, pad_vocab_multiple=1)).to(device)
    ids = torch.zeros(1, 8, dtype=torch.long, device=device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        warm(ids, ids)[1].backward()
    torch.optim.AdamW(warm.parameters()).step()
    del warm, ids
    baseline = rss_bytes()
    torch.manual_seed(0)
    config = model_config(model, block_size)
    gpt = GPT(config).to(device).train()
    if checkpointing:
        if not hasattr(gpt, "activation_checkpointing"):
            raise UserError("this checkout's GPT has no activation_checkpointing attribute; measure without "
                            "--activation_checkpointing")
        gpt.activation_checkpointing = True
    gpt.loss_chunk_rows = loss_chunk_rows
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-4)
    x, y = torch.randint(0, config.vocab_size, (2, micro_batch_size, block_size), device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            _, loss = gpt(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else rss_bytes()
    return {"model": model, "micro_batch_size": micro_batch_size, "block_size": block_size, "device": device,
            "activation_checkpointing": checkpointing, "baseline_bytes": baseline, "peak_bytes": peak,
            "torch": torch.__version__, "loss": loss.item()}


def planned(model: str, micro_batch_size: int, block_size: int, device: str, checkpointing: bool,
            loss_chunk_rows: int | None = None) -> int:
    """The plan's peak for `measure`'s step: fp32 on the CPU (with the process's RSS), bf16 autocast on CUDA."""
    launch = Launch(micro_batch_size, activation_checkpointing=checkpointing,
                    dtype="bf16" if device == "cuda" else "fp32", device=device, loss_chunk_rows=loss_chunk_rows)
    return plan_memory(model_config(model, block_size), launch).peak


def measure_in_subprocess(model: str, micro_batch_size: int, block_size: int, device: str = "cpu",
                          checkpointing: bool = False, fixed_threshold: bool = True,
                          loss_chunk_rows: int | None = None) -> dict:
    """`measure` in a fresh process (its peak RSS is this shape's alone), with the plan's prediction beside it."""
    env = {**os.environ, **(MEASURE_ENV if fixed_threshold else {})}
    cmd = [sys.executable, "-m", "benchmarks.memory_plan", "--measure", "--model", model, "--micro_batch_size",
           str(micro_batch_size), "--block_size", str(block_size), "--device", device]
    cmd += ["--activation_checkpointing"] if checkpointing else []
    cmd += [] if loss_chunk_rows is None else ["--loss_chunk_rows", str(loss_chunk_rows)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise UserError(f"measuring {model} {micro_batch_size} x {block_size} failed: {proc.stderr.strip()[-300:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["planned_bytes"] = planned(model, micro_batch_size, block_size, device, checkpointing, loss_chunk_rows)
    if device == "cpu":  # the process's own RSS as this process measured it, not the plan's typical figure
        result["planned_bytes"] += result["baseline_bytes"] - CPU_PROCESS_BYTES
    result["error"] = result["planned_bytes"] / result["peak_bytes"] - 1
    return result


def validate(checkpointing: bool) -> int:
    import torch

    print(f"planned vs measured peak, torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, fp32, "
          "two steps (forward, backward, AdamW) per fresh process")
    print(f"{'shape':<24} {'planned GiB':>11} {'measured GiB':>12} {'error':>7}   {'RSS, glibc default':>18}")
    worst = 0.0
    for model, mb, block in VALIDATION_SHAPES:
        r = measure_in_subprocess(model, mb, block, "cpu", checkpointing)
        default = measure_in_subprocess(model, mb, block, "cpu", checkpointing, fixed_threshold=False)
        worst = max(worst, abs(r["error"]))
        print(f"{model + f' {mb} x {block}' + (' AC' if checkpointing else ''):<24} "
              f"{r['planned_bytes'] / GiB:11.3f} {r['peak_bytes'] / GiB:12.3f} {r['error']:+7.1%}   "
              f"{default['peak_bytes'] / GiB:11.3f} ({default['error']:+.1%})", flush=True)
    print(f"largest error {worst:.1%} (the target: within 15%); measured: peak RSS with {MEASURE_ENV} (every "
          "tensor mmapped, so freed ones leave the RSS: the bytes tensors hold); the last column: glibc's default, "
          "whose heap keeps freed pages")
    return 0 if worst <= TOLERANCE else 1


def table(device_gb: float, loss_chunk_rows: int | None = None) -> None:
    """The largest micro-batch (x 1024 tokens) that fits per device, by model and layout: 8 processes, bf16; the
    loss on `loss_chunk_rows`'s path (None: CUDA's default)."""
    device = int(device_gb * GB)
    rows = Launch(1, loss_chunk_rows=loss_chunk_rows).loss_rows
    print(f"largest micro-batch (sequences of 1024 tokens) per {device_gb:g} GB device, 8 processes, bf16 (autocast; "
          f"FSDP2 and DeepSpeed: bf16 parameters), AdamW, eager, {describe_loss_path(rows)}, gradients held between "
          "micro-steps; computed by benchmarks.memory_plan (1 GiB + 10% kept free), not measured")
    # the support table's column names (training.distributed.support), each engine's layout over 8 processes
    engines = {p.column: Layout(8, p) for p in (Parallelism(DDP), Parallelism(FSDP),
                                                *(Parallelism(DEEPSPEED, stage) for stage in (1, 2, 3)))}
    print("| model | " + " | ".join(f"{e} | {e} + AC" for e in engines) + " |")
    print("| --- " * (1 + 2 * len(engines)) + "|")
    for name in TABLE_MODELS:
        config = model_config(name, 1024)
        cells = []
        for layout in engines.values():
            for checkpointing in (False, True):
                launch = Launch(1, layout, activation_checkpointing=checkpointing, accumulation=2,
                                loss_chunk_rows=loss_chunk_rows)
                mb = largest_micro_batch(config, launch, device, TABLE_CAP)
                cells.append("does not fit" if not mb else f"{mb}+" if mb == TABLE_CAP else str(mb))
        params = plan_memory(config, Launch(1)).params.total
        print(f"| {name} ({params / 1e6:,.0f}M) | " + " | ".join(cells) + " |")


def main() -> int:
    parser = CliParser(prog="python -m benchmarks.memory_plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help=f"size: {', '.join(SIZES)}")
    parser.add_argument("--micro_batch_size", type=int, default=8, help="sequences per forward pass per process")
    parser.add_argument("--block_size", type=int, default=None, help="tokens per sequence; default: the size's own")
    parser.add_argument("--processes", type=int, default=1, help="processes (devices) of the launch")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2: parameters, gradients, optimizer state sharded")
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="DeepSpeed ZeRO stage: 1 shards "
                        "the optimizer state, 2 also the gradients, 3 also the parameters (bf16: DeepSpeed's, bf16 "
                        "weights and an fp32 master copy)")
    parser.add_argument("--activation_checkpointing", action="store_true", help="keep only each block's input")
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="muon: Muon on the blocks' "
                        "matrices, AdamW on the rest")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES, help="bf16: accelerate's autocast, fp32 master "
                        "weights")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-steps per optimizer step (above 1 "
                        "the gradients are held through the forward)")
    parser.add_argument("--device", default="cuda", choices=DEVICES, help="cpu adds the process's own RSS")
    parser.add_argument("--grad_clip", type=float, default=1.0, help="train.py's --grad_clip: 0 lets --optimizer muon "
                        "run under --zero (DeepSpeed's Muon)")
    parser.add_argument("--loss_chunk_rows", type=int, default=None, help="the training loss's path (train.py's "
                        "--loss_chunk_rows): 0 the full logits, N the logits N tokens at a time; default: the "
                        "device's (512 on cpu, 0 on cuda)")
    parser.add_argument("--device_memory", type=float, default=None, help="GB (10^9 bytes) per device; default: "
                        f"{DEFAULT_DEVICE_GB:g} for cuda, this machine's memory shared by --processes for cpu")
    parser.add_argument("--eval_batch_size", type=int, default=None, help="validation windows or HellaSwag items "
                        "per evaluation forward; default: --micro_batch_size (train.py's default)")
    parser.add_argument("--hellaswag", action="store_true", help="the run scores HellaSwag (--hellaswag_every)")
    parser.add_argument("--hub_push_every", action="store_true", help="the run stages checkpoints for the Hub "
                        "(--push_to_hub with --hub_push_every)")
    parser.add_argument("--tensor_parallel", type=int, default=1, help="split each block's matrices over groups of "
                        "N processes (train.py's --tensor_parallel; needs --fsdp, FSDP2 across the groups)")
    parser.add_argument("--validate", action="store_true", help="planned vs measured peak RSS, CPU, 5 shapes")
    parser.add_argument("--table", action="store_true", help="the largest micro-batch by model and layout")
    parser.add_argument("--measure", action="store_true", help="measure this one shape in this process (JSON)")
    parser.add_argument("--check", action="store_true", help="measure this shape on --device in a fresh process "
                        "and compare with the plan: one JSON line; exit status 1 beyond 15%%")
    args = parser.parse_args()
    if args.device_memory is None:
        args.device_memory = DEFAULT_DEVICE_GB if args.device == "cuda" else machine_memory() / args.processes / GB
    if args.device_memory <= 0:
        raise UserError(f"--device_memory must be positive GB, got {args.device_memory}; e.g. 80 for an H100")
    if args.block_size is not None and args.block_size < 1:
        raise UserError(f"--block_size must be positive, got {args.block_size}; e.g. 1024")
    if args.fsdp and args.zero:
        raise UserError(f"--fsdp and --zero {args.zero} are two engines; plan one launch at a time (drop --fsdp or "
                        "--zero)")
    if args.validate:
        return validate(args.activation_checkpointing)
    if args.table:
        table(args.device_memory, args.loss_chunk_rows)
        return 0
    if args.model not in SIZES:
        raise UserError(f"--model {args.model!r} is not a size the planner knows; choose one of {', '.join(SIZES)}")
    config = model_config(args.model, args.block_size)
    engine = DEEPSPEED if args.zero else FSDP if args.fsdp else DDP
    layout = Layout(args.processes, Parallelism(engine, args.zero, tensor_parallel=args.tensor_parallel))
    launch = Launch(args.micro_batch_size, layout, activation_checkpointing=args.activation_checkpointing,
                    optimizer=args.optimizer, dtype=args.dtype, accumulation=args.accumulation, device=args.device,
                    loss_chunk_rows=args.loss_chunk_rows, grad_clip=args.grad_clip)
    if args.check:
        result = measure_in_subprocess(args.model, args.micro_batch_size, config.block_size, args.device,
                                       args.activation_checkpointing, loss_chunk_rows=args.loss_chunk_rows)
        print("PLAN_CHECK " + json.dumps(result))
        return 0 if abs(result["error"]) <= TOLERANCE else 1
    if args.measure:
        print(json.dumps(measure(args.model, args.micro_batch_size, config.block_size, args.device,
                                 args.activation_checkpointing, args.loss_chunk_rows)))
        return 0
    device = int(args.device_memory * GB)
    run = RunPhases(eval_batch_size=args.eval_batch_size or args.micro_batch_size,
                    evaluations=("validation", "hellaswag") if args.hellaswag else ("validation",),
                    hub_staging=args.hub_push_every)
    print(render(plan_memory(config, launch), device, run=run))
    return 0 if run_advice(config, launch, run, device) is None else 1


def cli() -> None:
    raise SystemExit(main())


if __name__ == "__main__":
    run_cli(cli)
