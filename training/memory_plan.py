"""How much memory one training process needs, computed from the model's shapes: the memory planner.

`plan_memory(GPTConfig, Launch)` adds up, per device, what a step of this project's code holds: the fp32
parameters, their gradients, the optimizer state (AdamW: two fp32 tensors per parameter; Muon: one momentum
buffer on the blocks' matrices and AdamW's two on the rest, as `training.optim` splits them), DDP's gradient
buckets, FSDP2's sharding and its unsharded blocks in flight, the bf16 weight copies autocast keeps, the
activations autograd saves (per layer, from `model.gpt.Block`'s code path) and the chunked loss's buffers
(`model.loss`). `benchmarks/memory_plan.py` is its command line; `python train.py ... --plan` prints it for a
run's resolved config (`exit_after_plan`). Everything here is arithmetic: nothing is allocated or measured.

What one Block saves for its backward (B x T x C = one "BTC"; a = bytes of an activation: 2 under bf16, 4
in fp32; r = bytes of the residual stream: fp32 under autocast because the embeddings' sum is fp32, bf16 under
FSDP2's bf16 parameters), checked against torch's saved-tensor hooks (tests/test_memory_plan.py):
  the two LayerNorm inputs (the residual stream, 2 x r BTC) and their mean/rstd (4 x 4 BT bytes);
  c_attn's input (a BTC), its output q, k, v (3a BTC), SDPA's output, which is also c_proj's input (a BTC;
  flash / memory-efficient SDPA, on CUDA and on the CPU alike, keeps a logsumexp of 4 x B x H x T bytes, never
  the T x T scores), c_fc's input (a BTC), the GELU's input and output (2 x 4a BTC):  2r + 14a bytes per BTC.
  Dropout > 0 adds a one-byte mask per element at each of its three places (attention's output, the MLP's
  output, and once the embeddings) - the attention-probability dropout inside SDPA is not modelled.
  With activation checkpointing only each block's input (r BTC) is kept, plus one block's full set while it is
  recomputed in the backward.
The loss keeps (B*T x C) gradients and a weight-sized one from its forward, with one (512 x V) fp32 logits
buffer while it runs (`model.loss.LOSS_CHUNK_ROWS`).

The peak is the largest of three moments: the forward's end (activations + the loss's working set), the
backward's start (activations + the loss's two gradients and their scaled copies) and the optimizer step
(parameters + gradients + state + the step's temporaries). It is a plan for eager PyTorch: torch.compile saves
fewer activations (it recomputes cheap ones), so a compiled run needs less, not more. Allocator slack
(the CUDA caching allocator's fragmentation, NCCL's buffers, the CUDA context of ~0.5 GiB) is not in it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from common.errors import UserError
from model.config import SIZES, GPTConfig
from model.loss import LOSS_CHUNK_ROWS
from training.network import scratch_architecture
from training.optim import plan_optimizers
from training.processes import BatchGeometry

GiB = 2**30
GB = 10**9
DEFAULT_DEVICE_GB = 80.0  # an H100 / A100 80 GB
DTYPES = ("bf16", "fp32")
OPTIMIZERS = ("adamw", "muon")
DEVICES = ("cuda", "cpu")
# RSS of a CPU process with torch and the project's modules imported and one tiny step run (the kernels' thread
# pools and workspaces): 0.31 GiB measured on the 2-core EPYC of docs/benchmarks.md, torch 2.13
# (benchmarks/memory_plan.py --validate measures it again in each process it compares).
CPU_PROCESS_BYTES = int(0.31 * GiB)
# Kept free on a CUDA device when judging a fit: the CUDA context (~0.5 GiB, with NCCL's buffers ~1 GiB) and the
# caching allocator's fragmentation (blocks cached but not reusable at another size): 10% of the peak.
CUDA_CONTEXT_BYTES = GiB
ALLOCATOR_SLACK = 0.10


@dataclass(frozen=True)
class Launch:
    """What a training process does with the model: its batch, its share of the model, its precision."""

    micro_batch_size: int
    processes: int = 1
    fsdp: bool = False
    activation_checkpointing: bool = False
    optimizer: str = "adamw"  # "adamw" or "muon" (training.optim's split)
    dtype: str = "bf16"  # "bf16": accelerate's autocast (fp32 master weights), "fp32": no autocast
    accumulation: int = 1  # micro-steps per optimizer step: above 1 the gradients live through the forward
    device: str = "cuda"  # "cpu" adds the process's own RSS (Python, torch) and AdamW's for-loop temporaries
    # The tokens of one optimizer step when the run fixes them (train.py --plan): the advice then names only the
    # micro-batches the run accepts, with the accumulation each gives (`resized`). None: any micro-batch.
    total_batch_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "processes", "accumulation"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be positive, got {getattr(self, name)}; pass a value of at least 1")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"optimizer {self.optimizer!r} is not one the planner knows; use adamw or muon")
        if self.dtype not in DTYPES:
            raise UserError(f"precision {self.dtype!r} is not one the planner knows; use bf16 or fp32")
        if self.device not in DEVICES:
            raise UserError(f"device {self.device!r} is not one the planner knows; use cuda or cpu")
        if self.fsdp and self.optimizer == "muon":
            raise UserError("Muon is refused under FSDP (it orthogonalises whole matrices, FSDP shards them); "
                            "use --optimizer adamw with FSDP")


@dataclass(frozen=True)
class ParamCounts:
    """The model's parameters by where they go (a tied weight once)."""

    block_matrices: int  # the 2-D weights inside the transformer blocks (Muon's, with --optimizer muon)
    block_vectors: int  # the blocks' biases and LayerNorm weights
    embeddings: int  # token (padded vocabulary, tied to the output layer) and position embeddings
    final_norm: int  # ln_f

    @property
    def total(self) -> int:
        return self.block_matrices + self.block_vectors + self.embeddings + self.final_norm

    @classmethod
    def of(cls, config: GPTConfig) -> ParamCounts:
        C, L, bias = config.n_embd, config.n_layer, config.bias
        norm = 2 * C if bias else C
        vectors = (3 * C + C + 4 * C + C if bias else 0) + 2 * norm
        return cls(block_matrices=L * 12 * C * C, block_vectors=L * vectors,
                   embeddings=(config.padded_vocab_size + config.block_size) * C, final_norm=norm)


@dataclass(frozen=True)
class Item:
    name: str
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    """The bytes one process holds at its peak, by item; `peak` is their sum at the largest moment."""

    config: GPTConfig
    launch: Launch
    params: ParamCounts
    activation_per_layer: int  # saved for the backward by one Block (without checkpointing)
    by_moment: dict[str, list[Item]] = field(default_factory=dict)  # what each moment holds, in table order

    @property
    def moments(self) -> dict[str, int]:
        """Every moment's total."""
        return {name: sum(i.bytes for i in items) for name, items in self.by_moment.items()}

    @property
    def moment(self) -> str:
        """The moment of the peak."""
        totals = self.moments
        return max(totals, key=totals.get)

    @property
    def items(self) -> list[Item]:
        """What is held at the peak."""
        return self.by_moment[self.moment]

    def bytes_of(self, name: str) -> int:
        """An item's bytes at the first moment that holds it (e.g. "activations": at the forward's end)."""
        return next(i.bytes for items in self.by_moment.values() for i in items if i.name == name)

    @property
    def peak(self) -> int:
        return sum(item.bytes for item in self.items)

    @property
    def reserve(self) -> int:
        """What a CUDA process needs beside its tensors: the CUDA context and the caching allocator's slack."""
        return 0 if self.launch.device == "cpu" else CUDA_CONTEXT_BYTES + int(ALLOCATOR_SLACK * self.peak)

    def fits(self, device_bytes: int) -> bool:
        return self.peak + self.reserve <= device_bytes


def activation_bytes_per_layer(config: GPTConfig, launch: Launch) -> int:
    """What one Block saves for its backward, in bytes (the module docstring lists each tensor)."""
    B, T, C, H = launch.micro_batch_size, config.block_size, config.n_embd, config.n_head
    a = 2 if launch.dtype == "bf16" else 4
    r = _residual_bytes(launch)
    btc = B * T * C
    saved = btc * (2 * r + 14 * a) + 4 * (4 * B * T) + 4 * B * H * T
    if config.dropout > 0:
        saved += 2 * btc  # one-byte masks after attention and after the MLP
    return saved


def _residual_bytes(launch: Launch) -> int:
    return 2 if launch.dtype == "bf16" and launch.fsdp else 4


def _compute_param_bytes(launch: Launch) -> int:
    """Bytes of a parameter as the forward uses it: FSDP2 all-gathers bf16 copies (accelerate's
    MixedPrecisionPolicy(param_dtype=bf16)); otherwise the fp32 parameter itself."""
    return 2 if launch.dtype == "bf16" and launch.fsdp else 4


def plan_memory(config: GPTConfig, launch: Launch) -> MemoryPlan:
    """The per-process peak of a training step of `config` under `launch`, by item (see the module docstring)."""
    counts = ParamCounts.of(config)
    P, N = counts.total, launch.processes
    shard = N if launch.fsdp else 1
    B, T, C, L, V = launch.micro_batch_size, config.block_size, config.n_embd, config.n_layer, config.padded_vocab_size
    ddp = N > 1 and not launch.fsdp
    bf16 = launch.dtype == "bf16"
    pc = _compute_param_bytes(launch)
    btc = B * T * C

    params = Item("parameters", 4 * P // shard, f"{P / 1e6:,.1f}M fp32" + (f", sharded over {N}" if shard > 1 else ""))
    grads = Item("gradients", 4 * P // shard, "fp32" + (f", sharded over {N}" if shard > 1 else ""))
    if launch.optimizer == "muon":
        muon = counts.block_matrices
        state = Item("optimizer state", (4 * muon + 8 * (P - muon)) // shard,
                     "Muon momentum on the blocks' matrices, AdamW's 2 on the rest")
    else:
        state = Item("optimizer state", 8 * P // shard, "AdamW: 2 fp32 tensors per parameter"
                     + (f", sharded over {N}" if shard > 1 else ""))
    static = [params, state]
    if ddp:
        static.append(Item("DDP gradient buckets", 4 * P, "a flat copy of the gradients for the all-reduce"))
    block_params = (counts.block_matrices + counts.block_vectors) // L
    root_params = counts.embeddings + counts.final_norm
    if launch.fsdp:
        static.append(Item("FSDP2 unsharded in flight", pc * (root_params + 2 * block_params),
                           "embeddings and ln_f (the root) + 2 blocks (this one and the prefetched one)"))
    elif bf16:
        static.append(Item("bf16 weight copies", 2 * (counts.block_matrices + V * C),
                           "autocast's casts of the matrices, kept for the backward"))
    if launch.accumulation > 1:
        static.append(replace(grads, note=grads.note + ", kept between micro-steps"))

    per_layer = activation_bytes_per_layer(config, launch)
    r = _residual_bytes(launch)
    final_norm_input = btc * r + 8 * B * T
    if launch.activation_checkpointing:
        activations = Item("activations", L * btc * r + final_norm_input + per_layer,
                           f"checkpointed: {L} block inputs of {_gib(btc * r)} + one block recomputed "
                           f"({_gib(per_layer)})")
    else:
        dropout = btc if config.dropout > 0 else 0
        activations = Item("activations", L * per_layer + final_norm_input + dropout,
                           f"{L} layers x {_gib(per_layer)} + the final LayerNorm's input")
    weight_grad = (2 if bf16 and launch.fsdp else 4) * V * C  # the loss's output-layer gradient, in wte's dtype
    rows = min(B * T, LOSS_CHUNK_ROWS)
    autocast_temps = 2 * rows * V + 2 * V * C if bf16 else 0  # bf16 logits and weight-gradient products
    loss_forward = 4 * rows * V + 8 * btc + weight_grad + autocast_temps
    loss_backward = 8 * btc + 2 * weight_grad  # its saved gradients and their scaled copies
    fsdp_grads_in_flight = pc * (root_params + block_params) if launch.fsdp else 0

    moments: dict[str, list[Item]] = {
        "forward's end": [*static, activations, Item("loss (chunked)", loss_forward,
                                                     f"a {rows} x {V} fp32 logits buffer, its gradients")],
        "backward's start": [*static, activations,
                             Item("loss (chunked)", loss_backward, "its two gradients, scaled")]
                            + ([Item("FSDP2 unsharded gradients", fsdp_grads_in_flight,
                                     "the root's and one block's, before their reduce-scatter")]
                               if launch.fsdp else []),
        "optimizer step": [params, grads, state] + [i for i in static if i.name in
                                                     ("DDP gradient buckets",)]
                          + ([Item("step temporaries", 2 * 4 * V * C // shard,
                                   "AdamW's for-loop on the CPU: 2 copies of the largest parameter")]
                             if launch.device == "cpu" else []),
    }
    if launch.device == "cpu":
        for items in moments.values():
            items.append(Item("process", CPU_PROCESS_BYTES, "Python, torch, its kernels' workspaces (measured)"))
    return MemoryPlan(config, launch, counts, per_layer, moments)


def _gib(n: int) -> str:
    return f"{n / GiB:.3f} GiB" if n < GiB / 10 else f"{n / GiB:.2f} GiB"


def resized(config: GPTConfig, launch: Launch, micro_batch_size: int, processes: int | None = None) -> Launch | None:
    """`launch` at another micro-batch (and number of processes). With a fixed total batch only a micro-batch the
    run accepts (`BatchGeometry`'s rule), at the accumulation it gives; None for one the run would refuse."""
    processes = launch.processes if processes is None else processes
    if launch.total_batch_size is None:
        return replace(launch, micro_batch_size=micro_batch_size, processes=processes)
    if not BatchGeometry.divides(launch.total_batch_size, micro_batch_size, config.block_size, processes):
        return None
    geometry = BatchGeometry.for_total(launch.total_batch_size, micro_batch_size, config.block_size, processes)
    return replace(launch, micro_batch_size=micro_batch_size, processes=processes, accumulation=geometry.accumulation)


def largest_micro_batch(config: GPTConfig, launch: Launch, device_bytes: int, limit: int = 1024) -> int:
    """The largest micro-batch (<= limit) that the run accepts and whose plan fits in `device_bytes`; 0 when none
    does. Every candidate is planned, from the largest down: with a fixed total batch the accumulation changes with
    the micro-batch (and with it whether the gradients are held between micro-steps), so the peak is not monotone."""
    for micro_batch_size in range(limit, 0, -1):
        candidate = resized(config, launch, micro_batch_size)
        if candidate is not None and plan_memory(config, candidate).fits(device_bytes):
            return micro_batch_size
    return 0


@dataclass(frozen=True)
class Spelling:
    """How an entry point names the three settings in its advice."""

    micro_batch: str = "--micro_batch_size"
    fsdp: str = "--fsdp"
    checkpointing: str = "--activation_checkpointing"
    processes: str = "--processes"


def advice(config: GPTConfig, launch: Launch, device_bytes: int, spelling: Spelling = Spelling()) -> str | None:
    """None when the plan fits; else one line: what does not fit and the one setting to change."""
    plan = plan_memory(config, launch)
    if plan.fits(device_bytes):
        return None
    where = f"needs {_gib(plan.peak + plan.reserve)} per device, more than the {device_bytes / GB:g} GB device"
    B = launch.micro_batch_size
    if (mb := largest_micro_batch(config, launch, device_bytes, B - 1)) > 0:
        return f"micro-batch {B} {where}; lower {spelling.micro_batch} to {mb} (the batch keeps its tokens " \
               "through more accumulation)"
    if not launch.activation_checkpointing:
        checkpointed = replace(launch, activation_checkpointing=True)
        if (mb := largest_micro_batch(config, checkpointed, device_bytes, B)) > 0:
            return f"micro-batch {B} {where}; add {spelling.checkpointing}" + \
                   (f" (it fits then at micro-batch {B})" if mb == B else f" and lower {spelling.micro_batch} to {mb}")
    if not launch.fsdp and launch.processes > 1 and launch.optimizer == "adamw":
        for checkpointing in (launch.activation_checkpointing, True):
            sharded = replace(launch, fsdp=True, activation_checkpointing=checkpointing)
            if (mb := largest_micro_batch(config, sharded, device_bytes, B)) > 0:
                extra = "" if checkpointing == launch.activation_checkpointing else f" and {spelling.checkpointing}"
                return f"micro-batch {B} {where}; shard it with {spelling.fsdp}{extra}" + \
                       ("" if mb == B else f", at {spelling.micro_batch} {mb}")
    if launch.optimizer == "muon" and launch.processes > 1:
        return f"micro-batch {B} {where}, even at micro-batch 1; use --optimizer adamw with {spelling.fsdp} " \
               "(Muon is refused under FSDP)"
    sharded = replace(launch, fsdp=True, activation_checkpointing=True)

    def fits_on(processes: int) -> bool:
        candidate = resized(config, sharded, 1, processes)
        return candidate is not None and plan_memory(config, candidate).fits(device_bytes)

    devices = next((n for n in (2**k for k in range(1, 11)) if n > launch.processes and fits_on(n)), None)
    return f"micro-batch {B} {where}, even at micro-batch 1 with {spelling.checkpointing}" + \
           (f" and {spelling.fsdp}" if launch.fsdp else "") + \
           (f"; shard it with {spelling.fsdp} over {devices} devices ({spelling.processes} {devices})"
            if devices and launch.optimizer == "adamw" else "; use a larger device")


def render(plan: MemoryPlan, device_bytes: int, spelling: Spelling = Spelling()) -> str:
    """The plan as a table (GiB), the activations per layer, and the verdict against the device."""
    c, l_ = plan.config, plan.launch
    how = "FSDP2" if l_.fsdp else ("DDP" if l_.processes > 1 else "one process")
    lines = [
        f"Memory plan (computed from the shapes, not measured): {c.n_layer} layers x {c.n_embd} wide, {c.n_head} "
        f"heads, vocabulary {c.padded_vocab_size} (padded), {plan.params.total / 1e6:,.1f}M parameters",
        f"  micro-batch {l_.micro_batch_size} x {c.block_size} tokens, {l_.processes} process(es), {how}, "
        f"{l_.dtype}{' autocast' if l_.dtype == 'bf16' else ''}, {l_.optimizer}, activation checkpointing "
        f"{'on' if l_.activation_checkpointing else 'off'}, accumulation {l_.accumulation}, device {l_.device}",
        f"  activations per layer: {_gib(plan.activation_per_layer)} (one Block's saved tensors"
        + (", recomputed: only its input is kept" if l_.activation_checkpointing else "") + ")",
        f"  per device, at the peak ({plan.moment}):",
    ]
    width = max(len(i.name) for i in plan.items)
    for item in plan.items:
        lines.append(f"    {item.name:<{width}}  {item.bytes / GiB:8.2f} GiB  {item.note}")
    lines.append(f"    {'total':<{width}}  {plan.peak / GiB:8.2f} GiB")
    if plan.reserve:
        lines.append(f"    {'reserve':<{width}}  {plan.reserve / GiB:8.2f} GiB  CUDA context (1 GiB) and allocator "
                     f"slack ({ALLOCATOR_SLACK:.0%} of the total)")
    lines.append(f"    {'device':<{width}}  {device_bytes / GiB:8.2f} GiB  ({device_bytes / GB:g} GB)")
    others = ", ".join(f"{name} {total / GiB:.2f} GiB" for name, total in plan.moments.items() if name != plan.moment)
    lines.append(f"  other moments: {others}")
    line = advice(plan.config, plan.launch, device_bytes, spelling)
    spare = device_bytes - plan.peak - plan.reserve
    lines.append("  fits: " + (f"yes, {spare / GiB:.2f} GiB to spare" if line is None else "NO: " + line))
    return "\n".join(lines)


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


def launch_environment() -> dict[str, object]:
    """What `accelerate launch` tells the processes it starts: how many, FSDP, the precision, the CPU."""
    env = os.environ
    return {"processes": int(env.get("WORLD_SIZE", "1")),
            "fsdp": env.get("ACCELERATE_USE_FSDP", "false").lower() == "true",
            "dtype": "bf16" if env.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16" else "fp32",
            "device": "cpu" if env.get("ACCELERATE_USE_CPU", "false").lower() == "true" else "cuda"}


def device_here(device: str) -> tuple[int, str]:
    """The bytes of the device a plan for a `device` ("cuda" or "cpu") launch is made against, and a line that
    says which: this machine's first GPU, else the default 80 GB (a plan for a GPU run is often made on a machine
    without one, which has no size to read)."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties(0)
        return gpu.total_memory, f"  planned for cuda:0 of this machine: {gpu.name}, {gpu.total_memory / GB:.1f} GB"
    what = (f"an {DEFAULT_DEVICE_GB:g} GB CUDA device (an H100 / A100 80 GB), as this machine has none"
            if device == "cuda" else f"{DEFAULT_DEVICE_GB:g} GB of memory (the planner's default, not this machine's)")
    return int(DEFAULT_DEVICE_GB * GB), (
        f"  planned for {what}; for another size, python -m benchmarks.memory_plan --device {device} --device_memory "
        "GB (with --model, --micro_batch_size, --processes), or --plan on the machine that trains")


def exit_after_plan(cfg):
    """`python train.py ... --plan`: print the memory plan of this config and launch, exit 0 before anything is
    built. Otherwise return `cfg` unchanged. The shapes come from the flags, or from `--init_from` when it names
    one of GPT-2's sizes; processes, FSDP and precision from the accelerate launch (its environment)."""
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
    env = launch_environment()
    geometry = BatchGeometry.for_total(cfg.training.total_batch_size, cfg.training.micro_batch_size,
                                       config.block_size, int(env["processes"]))  # the run's rule, and refusal
    launch = Launch(micro_batch_size=geometry.micro_batch_size, processes=geometry.world_size,
                    fsdp=bool(env["fsdp"]), activation_checkpointing=cfg.training.activation_checkpointing,
                    optimizer=plan_optimizers(cfg.optim, model).kind,  # --optimizer auto resolved as a run does
                    dtype=str(env["dtype"]), accumulation=geometry.accumulation, device=str(env["device"]),
                    total_batch_size=cfg.training.total_batch_size)  # so that advised micro-batches divide it
    if int(os.environ.get("RANK", "0")) == 0:
        device_bytes, which = device_here(launch.device)
        print(render(plan_memory(config, launch), device_bytes,
                     Spelling(fsdp="accelerate_configs/fsdp_8gpu.yaml (FSDP2)", processes="--num_processes")))
        print(which)
    raise SystemExit(0)
