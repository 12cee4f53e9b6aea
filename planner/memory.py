"""How much memory one training process needs, computed from the model's shapes: the memory planner.

`plan_memory(GPTConfig, Launch)` adds up, per device, what a step of this project's code holds: the fp32
parameters, their gradients, the optimizer state (AdamW: two fp32 tensors per parameter; Muon: one momentum
buffer on the blocks' matrices and AdamW's two on the rest, as `training.optimizers.plan` splits them), DDP's gradient
buckets, FSDP2's sharding and its unsharded blocks in flight, the bf16 weight copies autocast keeps, the
activations autograd saves (per layer, from `model.gpt.Block`'s code path) and the loss's tensors, on the launch's
path (`model.loss`: chunked or the full logits). `benchmarks/memory_plan.py` is its command line; `python train.py
... --plan` prints it for a run's resolved config (`exit_after_plan`). Everything here is arithmetic: nothing is
allocated or measured.

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
Under tensor parallelism over N ranks (`--tensor_parallel`, `model.tensor_parallel`'s plan) a rank holds 1/N of
the blocks' matrices and column-wise biases (then FSDP2's share of that over the processes / N groups), and 1/N of
q, k, v, SDPA's output, the GELU's input and output (12a of the 14a) and the logsumexp; the LayerNorm inputs and
the two column-wise layers' inputs, the embeddings, the head and the loss stay whole on every rank (the
evaluations' forwards are planned unsplit: an overestimate).
The loss, on the path `Launch.loss_rows` names (`model.loss`; the run's --loss_chunk_rows, by default chunks on the
CPU and the full logits on CUDA):
  chunked (N rows): it keeps (B*T x C) gradients and a weight-sized one from its forward, with one (N x V) fp32
  logits buffer while it runs, and under autocast a bf16 chunk of logits and a bf16 weight-gradient product.
  full logits: F.linear keeps its input for the backward (a BTC: the autocast copy, or the residual stream's own
  dtype), and with L = B*T x V logits: the forward holds the fp32 upcast and its log-softmax at once (8 L bytes;
  the bf16 logits, 2 L, are freed by the upcast), keeps the log-softmax (4 L) for the backward, whose start holds
  it, its gradient and the gradient of the logits (12 L), all fp32; the bf16 gradient and the weight gradient come
  after, when these are freed. Measured on the CPU with torch.profiler's memory events (fp32 and bf16 autocast:
  8.0, 4.0 and 12.0 L); `tests/test_memory_plan.py` holds the saved part against autograd's saved tensors.
  Compiled, inductor fuses the upcast, the softmax and their backward, and keeps less: to be measured on a GPU.

The peak is the largest of three moments: the forward's end (activations + the loss's working set), the
backward's start (activations + the loss's two gradients and their scaled copies) and the optimizer step
(parameters + gradients + state + the step's temporaries). It is a plan for eager PyTorch: torch.compile saves
fewer activations (it recomputes cheap ones), so a compiled run needs less, not more. Allocator slack
(the CUDA caching allocator's fragmentation, NCCL's buffers, the CUDA context of ~0.5 GiB) is not in it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from common.errors import UserError
from common.parallelism import Parallelism
from configs import EvalConfig
from model.config import GPTConfig
from model.loss import LOSS_CHUNK_ROWS
from model.pipeline import stage_blocks
from model.tensor_parallel import split_problem
from planner.launch import GiB, Launch
from training.evaluations.registry import EVALUATIONS
from training.evaluations.spec import EvaluationSpec

# RSS of a CPU process with torch and the project's modules imported and one tiny step run (the kernels' thread
# pools and workspaces): 0.31 GiB measured on the 2-core EPYC of docs/benchmarks.md, torch 2.13
# (benchmarks/memory_plan.py --validate measures it again in each process it compares).
CPU_PROCESS_BYTES = int(0.31 * GiB)
# Kept free on a CUDA device when judging a fit: the CUDA context (~0.5 GiB, with NCCL's buffers ~1 GiB) and the
# caching allocator's fragmentation (blocks cached but not reusable at another size): 10% of the peak.
CUDA_CONTEXT_BYTES = GiB
ALLOCATOR_SLACK = 0.10
# The RSS of a train.py process on the CPU beside its tensors: torch, accelerate, the tokenizer, the data and
# evaluation modules. Measured by benchmarks/bench_run_memory.py (docs/benchmarks.md): a run's resident set between
# its phases less its parameters and AdamW's state, 0.45 GiB for GPT-2 124M and for `small` alike (2-core EPYC,
# torch 2.13); each evaluation declares what it adds (`EvaluationSpec.cpu_process_bytes`).
TRAIN_PROCESS_BYTES = int(0.45 * GiB)
# DeepSpeed's default reduce_bucket_size, in elements: ZeRO-1 and 2 reduce the gradients through buckets this large.
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000



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

    @classmethod
    def per_stage(cls, config: GPTConfig, parallelism: Parallelism, stage: int) -> ParamCounts:
        """What pipeline stage `stage` of `parallelism`'s holds (`model.pipeline`): its blocks; the embeddings on the
        first; ln_f and the tied output layer's copy of the token embedding on the last."""
        whole, stages = cls.of(config), parallelism.pipeline_parallel
        share = len(stage_blocks(config.n_layer, stages)[stage]) / config.n_layer
        first, last = stage == 0, stage == stages - 1
        wte = config.padded_vocab_size * config.n_embd
        return cls(block_matrices=round(whole.block_matrices * share), block_vectors=round(whole.block_vectors * share),
                   embeddings=(whole.embeddings if first else 0) + (wte if last and not first else 0),
                   final_norm=whole.final_norm if last else 0)

    @classmethod
    def per_rank(cls, config: GPTConfig, parallelism: Parallelism) -> ParamCounts:
        """What one rank of a tensor-parallel group holds (`model.tensor_parallel`'s plan): 1/degree of the blocks'
        matrices and of the column-wise layers' biases (c_attn's 3C, c_fc's 4C), the rest whole."""
        whole, tensor_parallel = cls.of(config), parallelism.tensor_parallel
        if tensor_parallel == 1:
            return whole
        split_biases = config.n_layer * 7 * config.n_embd if config.bias else 0
        return replace(whole, block_matrices=whole.block_matrices // tensor_parallel,
                       block_vectors=whole.block_vectors - split_biases + split_biases // tensor_parallel)



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
    stage: int | None = None  # the pipeline stage planned (the fuller one), None without pipeline parallelism

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
    tp = launch.layout.parallelism.tensor_parallel  # splits q, k, v, SDPA's output, the GELU's (12a BTC), logsumexp
    saved = btc * (2 * r + 2 * a) + btc * 12 * a // tp + 4 * (4 * B * T) + 4 * B * H * T // tp
    if config.dropout > 0:
        saved += 2 * btc  # one-byte masks after attention and after the MLP
    return saved



def _residual_bytes(launch: Launch) -> int:
    return 2 if launch.bf16_parameters else 4



def _compute_param_bytes(launch: Launch) -> int:
    """Bytes of a parameter as the forward uses it: FSDP2 all-gathers bf16 copies (accelerate's
    MixedPrecisionPolicy(param_dtype=bf16)); otherwise the fp32 parameter itself."""
    return 2 if launch.bf16_parameters else 4



@dataclass(frozen=True)
class _Share:
    """The part of the model one process's step holds: a tensor-parallel rank's, or a pipeline stage's."""

    counts: ParamCounts  # its parameters
    layers: int  # its blocks
    in_flight: int  # the micro-batches whose activations it holds at once (1F1B)
    last: bool  # it computes the loss (one process, or the last stage)

    @classmethod
    def of(cls, config: GPTConfig, launch: Launch, stage: int | None) -> _Share:
        parallelism = launch.layout.parallelism
        if stage is None:
            return cls(ParamCounts.per_rank(config, parallelism), config.n_layer, 1, True)
        stages = parallelism.pipeline_parallel
        return cls(ParamCounts.per_stage(config, parallelism, stage), len(stage_blocks(config.n_layer, stages)[stage]),
                   min(stages - stage, launch.accumulation), stage == stages - 1)

    @property
    def root_params(self) -> int:
        """FSDP2's root unit: the embeddings and ln_f."""
        return self.counts.embeddings + self.counts.final_norm

    @property
    def block_params(self) -> int:
        return (self.counts.block_matrices + self.counts.block_vectors) // self.layers



def plan_memory(config: GPTConfig, launch: Launch, process_bytes: int = CPU_PROCESS_BYTES,
                stage: int | None = None) -> MemoryPlan:
    """The per-process peak of a training step of `config` under `launch`, by item and moment.

    `process_bytes` is the process's own RSS on a CPU: a bare step's by default, train.py's from `plan_run`.
    Under pipeline parallelism it plans the fuller of the first and the last stage; `stage` plans that one."""
    parallelism = launch.layout.parallelism
    if parallelism.pipelined and stage is None:
        ends = (0, parallelism.pipeline_parallel - 1)
        return max((plan_memory(config, launch, process_bytes, s) for s in ends), key=lambda p: p.peak)
    _check_split(config, parallelism.tensor_parallel)
    share = _Share.of(config, launch, stage)
    weights = _weights_and_state(share.counts, launch)
    held = _held_through_the_step(config, launch, share, *weights)
    activations = _activations(config, launch, share)
    loss_forward, loss_backward = _loss(config, launch, share)
    moments: dict[str, list[Item]] = {
        "forward's end": [*held, activations, *loss_forward],
        "backward's start": [*held, activations, *loss_backward, *_unsharded_gradients(launch, share)],
        "optimizer step": _optimizer_step(config, launch, share, weights, held),
    }
    if launch.device == "cpu":
        for items in moments.values():
            items.append(_process_item(process_bytes))
    return MemoryPlan(config, launch, share.counts, activation_bytes_per_layer(config, launch), moments, stage)


def _check_split(config: GPTConfig, tp: int) -> None:
    """Refuse a tensor-parallel degree that cannot split this model, in the run's words."""
    if (problem := split_problem(config.n_head, config.n_embd, tp)) is not None:
        raise UserError(f"tensor parallel {tp} cannot split this model: {problem}; plan a degree that divides n_head")


def _held_through_the_step(config: GPTConfig, launch: Launch, share: _Share, params: Item, grads: Item,
                           state: Item) -> list[Item]:
    """What the forward and the backward hold beside the activations and the loss.

    They are the weights and optimizer state, the engine's buffers, autocast's weight copies, and the gradients kept
    between micro-steps."""
    layout, counts = launch.layout, share.counts
    P, pc = counts.total, _compute_param_bytes(launch)
    held = [params, state]
    if layout.full_replicas:
        held.append(Item("DDP gradient buckets", 4 * P, "a flat copy of the gradients for the all-reduce"))
    if layout.reduces_in_buckets:
        held.append(Item("DeepSpeed reduce buckets", pc * min(P, DEEPSPEED_BUCKET_ELEMENTS),
                         f"its reduce_bucket_size ({DEEPSPEED_BUCKET_ELEMENTS:.0e} elements by default)"))
    if layout.shards_parameters:
        held.append(Item(f"{layout.sharding_name} unsharded in flight",
                         pc * (share.root_params + 2 * share.block_params),
                         "embeddings and ln_f (the root) + 2 blocks (this one and the prefetched one)"))
    elif launch.dtype == "bf16" and not launch.bf16_parameters:
        head = config.padded_vocab_size * config.n_embd if share.last else 0
        held.append(Item("bf16 weight copies", 2 * (counts.block_matrices + head),
                         "autocast's casts of the matrices, kept for the backward"))
    if launch.accumulation > 1:
        held.append(replace(grads, note=grads.note + ", kept between micro-steps"))
    return held


def _activations(config: GPTConfig, launch: Launch, share: _Share) -> Item:
    """What autograd saves for the backward: every layer's tensors, or only each block's input when checkpointed."""
    B, T = launch.micro_batch_size, config.block_size
    btc = B * T * config.n_embd
    per_layer = activation_bytes_per_layer(config, launch)
    r = _residual_bytes(launch)
    L, in_flight = share.layers, share.in_flight
    final_norm_input = btc * r + 8 * B * T if share.last else 0
    flight = f" x {in_flight} micro-batches in flight (1F1B)" if in_flight > 1 else ""
    if launch.activation_checkpointing:
        return Item("activations", in_flight * (L * btc * r + final_norm_input) + per_layer,
                    f"checkpointed: {L} block inputs of {format_gib(btc * r)}{flight} + one block recomputed "
                    f"({format_gib(per_layer)})")
    dropout = btc if config.dropout > 0 else 0
    return Item("activations", in_flight * (L * per_layer + final_norm_input + dropout),
                f"{L} layers x {format_gib(per_layer)}" + (" + the final LayerNorm's input" if share.last else "")
                + flight)


def _loss(config: GPTConfig, launch: Launch, share: _Share) -> tuple[list[Item], list[Item]]:
    """The loss's item at the forward's end and at the backward's start, on the launch's path; none before the
    last stage."""
    if not share.last:
        return [], []
    B, T, C, V = launch.micro_batch_size, config.block_size, config.n_embd, config.padded_vocab_size
    btc, bf16 = B * T * C, launch.dtype == "bf16"
    if launch.loss_rows:  # the chunked loss
        weight_grad = (2 if launch.bf16_parameters else 4) * V * C  # the loss's output-layer gradient, in wte's dtype
        rows = min(B * T, launch.loss_rows)
        autocast_temps = 2 * rows * V + 2 * V * C if bf16 else 0  # bf16 logits and weight-gradient products
        return ([Item("loss (chunked)", 4 * rows * V + 8 * btc + weight_grad + autocast_temps,
                      f"a {rows} x {V} fp32 logits buffer, its gradients")],
                [Item("loss (chunked)", 8 * btc + 2 * weight_grad, "its two gradients, scaled")])
    logits, matmul_input = B * T * V, (2 if bf16 else 4) * btc  # the full logits
    return ([Item("loss (full logits)", 8 * logits + matmul_input, f"the fp32 {B * T} x {V} logits and their "
                  "log-softmax")],
            [Item("loss (full logits)", 12 * logits + matmul_input,
                  "the log-softmax, its gradient and the logits' gradient, fp32")])


def _unsharded_gradients(launch: Launch, share: _Share) -> list[Item]:
    """FSDP2's and ZeRO-3's gradients at the backward's start: the root's and one block's, not yet reduce-scattered."""
    if not launch.layout.shards_parameters:
        return []
    return [Item("unsharded gradients", _compute_param_bytes(launch) * (share.root_params + share.block_params),
                 "the root's and one block's, before their reduce-scatter")]


def _optimizer_step(config: GPTConfig, launch: Launch, share: _Share, weights: tuple[Item, Item, Item],
                    held: list[Item]) -> list[Item]:
    """What the optimizer step holds: the weights, their gradients and state, the engine's buckets, Muon's working
    set, and on a CPU AdamW's for-loop temporaries."""
    buckets = [i for i in held if i.name in ("DDP gradient buckets", "DeepSpeed reduce buckets")]
    temporaries = [Item("step temporaries", 2 * 4 * config.padded_vocab_size * config.n_embd
                        // launch.shards.optimizer_state,
                        "AdamW's for-loop on the CPU: 2 copies of the largest parameter")] \
        if launch.device == "cpu" else []
    return [*weights, *buckets, *_whole_matrix(config, launch), *_stacked_newton_schulz(config, launch, share.layers),
            *temporaries]



def _whole_matrix(config: GPTConfig, launch: Launch) -> list[Item]:
    """Muon where the matrices are DTensors (FSDP2, tensor parallelism included): the largest matrix (c_fc's 4C x C)
    gathered whole, its momentum-mixed update and Newton-Schulz's working copies (the iterate, its Gram matrix, the
    polynomial and the product: 4 of its size, fp32 at most), one matrix at a time. Under ZeRO, DeepSpeed's Muon
    (`training.optimizers.muon_deepspeed`) orthogonalises each whole gradient as it fills the partitions: the same
    allowance (its Gram iteration's working copies are no larger)."""
    zero = launch.layout.one_client_optimizer
    if not launch.optimizer_spec.whole_matrices or not (launch.layout.dtensor_matrices or zero):
        return []
    largest = 4 * config.n_embd * config.n_embd
    return [Item("Muon's whole matrix", 4 * 5 * largest, "the largest matrix orthogonalised whole by DeepSpeed's Muon, "
                 "and 4 working copies" if zero else "the largest matrix gathered for Newton-Schulz, and 4 working "
                 "copies")]


def _stacked_newton_schulz(config: GPTConfig, launch: Launch, layers: int) -> list[Item]:
    """Muon on whole matrices (one process, DDP, a pipeline stage): the matrices of one shape are orthogonalised
    together (`training.optimizers.muon_optimizer.Muon`), one shape at a time, the largest (c_fc's 4C x C, or
    mlp.c_proj's, one per layer) the peak. Of its `layers` matrices a rank orthogonalises its share (all of them, or
    split over the data-parallel ranks: ceil(layers / ranks)), then gathers the rest. The larger of the iteration
    (the share's fp32 update stack, the iterate and its next value in the Newton-Schulz dtype: 2 bytes on a GPU, 4
    at most on a CPU, and two C x C products per matrix) and the gather (the share's result and every matrix's)."""
    if not launch.optimizer_spec.whole_matrices or launch.layout.shards_optimizer_state:
        return []
    ranks = launch.layout.data_parallel_size
    share = -(-layers // ranks)
    C = config.n_embd
    matrix, ns = 4 * C * C, 2 if launch.device == "cuda" else 4
    iteration = share * (matrix * (4 + 2 * ns) + 2 * C * C * ns)
    gather = (share + ranks * share) * matrix * ns if ranks > 1 else 0
    split = f", {share} of them on this rank" if ranks > 1 else ""
    return [Item("Muon's stacked Newton-Schulz", max(iteration, gather),
                 f"one shape's {layers} matrices at once{split}")]


def _process_item(process_bytes: int) -> Item:
    return Item("process", process_bytes, "Python, torch, its kernels' workspaces (measured)")



def _weights_and_state(counts: ParamCounts, launch: Launch) -> tuple[Item, Item, Item]:
    """This process's parameters, gradients and optimizer state, each split as `launch.shards` says: fp32, but with
    an fp32 master copy (DeepSpeed's bf16) the module's parameters and gradients are bf16 and the optimizer keeps
    the copy."""
    P, shards = counts.total, launch.shards
    low = launch.fp32_master
    size, dtype = (2, "bf16") if low else (4, "fp32")
    params = Item("parameters", size * P // shards.parameters,
                  f"{P / 1e6:,.1f}M {dtype}" + shards.note(shards.parameters))
    grads = Item("gradients", size * P // shards.gradients, dtype + shards.note(shards.gradients))
    master = 4 * P // shards.optimizer_state if low else 0
    spec = launch.optimizer_spec
    what = (f"{spec.display}: {spec.state_bytes} bytes per parameter" if spec.alone else
            f"{spec.display}'s state on {spec.claims}, AdamW's 2 fp32 tensors on the rest")
    state = Item("optimizer state", spec.state_bytes_of(P, counts.block_matrices) // shards.optimizer_state + master,
                 what + (" + the fp32 master copy" if master else "") + shards.note(shards.optimizer_state))
    return params, grads, state



@dataclass(frozen=True)
class RunPhases:
    """What a run does besides its steps, as far as its memory goes (train.py's evaluation and saving settings)."""

    eval_batch_size: int  # validation windows (of block_size tokens) or HellaSwag items per evaluation forward
    # the registered evaluations that run (`training.evaluations`), in the registry's order; validation always does
    evaluations: tuple[str, ...] = ("validation",)
    hub_staging: bool = False  # --push_to_hub with --hub_push_every: a checkpoint converted on the main process

    def __post_init__(self) -> None:
        if self.eval_batch_size < 1:
            raise UserError(f"--eval_batch_size must be positive, got {self.eval_batch_size}; pass at least 1")
        if unknown := set(self.evaluations) - set(EVALUATIONS):
            raise UserError(f"no evaluation named {', '.join(sorted(unknown))}; plan {', '.join(EVALUATIONS)}")

    @classmethod
    def of_flags(cls, cfg: EvalConfig, parsed: Mapping[str, Any] | None = None, hub_staging: bool = False
                 ) -> RunPhases:
        """The phases a run with these evaluation flags goes through: the shared group, and each evaluation's own
        among `parsed` (`TrainConfig.added`; left out: their defaults)."""
        parsed = parsed or {}
        return cls(cfg.eval_batch_size, tuple(name for name, spec in EVALUATIONS.items()
                                              if spec.every(spec.flags_in(parsed))), hub_staging)

    @property
    def specs(self) -> list[EvaluationSpec]:
        return [EVALUATIONS[name] for name in EVALUATIONS if name in self.evaluations]



@dataclass(frozen=True)
class RunPlan:
    """Each phase of a run (the step, validation, HellaSwag, a checkpoint save, the export): what one process holds
    at that phase's peak. The run's peak is the largest; `phase` names it, `settings` the flag that lowers each."""

    step: MemoryPlan
    by_phase: dict[str, list[Item]]  # every phase but the step, in the run's order
    settings: dict[str, str]  # phase -> what lowers it

    @property
    def phases(self) -> dict[str, int]:
        """Every phase's peak, the step's first."""
        return {"step": self.step.peak, **{name: sum(i.bytes for i in items) for name, items in self.by_phase.items()}}

    @property
    def phase(self) -> str:
        totals = self.phases
        return max(totals, key=totals.get)

    @property
    def items(self) -> list[Item]:
        return self.step.items if self.phase == "step" else self.by_phase[self.phase]

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def reserve(self) -> int:
        return 0 if self.step.launch.device == "cpu" else CUDA_CONTEXT_BYTES + int(ALLOCATOR_SLACK * self.peak)

    def fits(self, device_bytes: int) -> bool:
        return self.peak + self.reserve <= device_bytes



def evaluation_bytes(config: GPTConfig, launch: Launch, rows: int, tokens: int) -> int:
    """What a no-grad evaluation forward of `rows` x `tokens` adds to what the process already holds: the larger of
    a block's live tensors (15 x rows x tokens x n_embd: the residual stream in and out, the q/k/v projection the
    block still holds, the second LayerNorm's output, the MLP's 4C-wide input and GELU output, its output) and the
    chunked loss's working set (its logits buffer, a weight-sized fp32 copy of the output layer and 4 of those
    tensors): measured with every tensor mmapped (docs/benchmarks.md), fp32; under bf16 autocast planned with the
    same counts at 2 bytes, the residual stream at 4."""
    a = 2 if launch.dtype == "bf16" else 4
    btc = rows * tokens * config.n_embd
    block = btc * (2 * 4 + 13 * a)
    loss = 4 * min(rows * tokens, LOSS_CHUNK_ROWS) * config.padded_vocab_size + 4 * config.padded_vocab_size * \
        config.n_embd + 4 * 4 * btc
    return max(block, loss)



def plan_run(config: GPTConfig, launch: Launch, run: RunPhases) -> RunPlan:
    """The peak of each phase of a run of `config` under `launch` (see `RunPlan`); on a CPU with train.py's own
    process RSS (`TRAIN_PROCESS_BYTES`, and what each evaluation it scores adds: `cpu_process_bytes`).

    Between steps a process keeps its parameters, the optimizer state and DDP's buckets (gradients are freed by
    `zero_grad(set_to_none=True)`). Evaluations add `evaluation_bytes` to that, each at the forward it declares
    (`EvaluationSpec.planned`: validation at `eval_batch_size` windows of block_size tokens, HellaSwag at 4 rows,
    its endings, per item). A checkpoint save
    first checks the weights on one window (`Checkpointer`'s health check); its writers copy nothing
    (safetensors and torch.save write from the tensors). The export follows the last save, which holds the optimizer
    state, so that state is freed first (`training.optimizers.plan.release_optimizer_state`): it holds the weights and,
    on the
    main process, the file's transposed block matrices (GPT-2's Conv1D layout) - on a CPU; on CUDA these are host
    copies. The Hub staging of a checkpoint loads it into a second model on the main process, and transposes too.
    Under pipeline parallelism the plan is the fuller stage's (`plan_memory`), and a checkpoint save and the export
    gather the whole model (with the optimizer state for a save) on the main process's host memory, where its
    files are written (`training.distributed.pipeline`)."""
    process = TRAIN_PROCESS_BYTES + sum(spec.cpu_process_bytes for spec in run.specs) if launch.device == "cpu" else 0
    step = plan_memory(config, launch, process)
    counts = step.params
    params, _, state = _weights_and_state(counts, launch)
    kept = [params, state]
    if launch.layout.full_replicas:
        kept.append(Item("DDP gradient buckets", 4 * counts.total, "kept by DDP between steps"))
    if process:
        kept.append(_process_item(process))
    B, T = run.eval_batch_size, config.block_size

    def evaluation(rows: int, tokens: int, what: str) -> Item:
        return Item("evaluation forward", evaluation_bytes(config, launch, rows, tokens), what)

    phases, settings = {}, {"step": ""}
    for spec in run.specs:
        rows, tokens, what = spec.planned(B, T)
        phases[spec.name] = kept + [evaluation(rows, tokens, what)]
        settings[spec.name] = "--eval_batch_size"
    host = launch.device == "cpu"
    gathered = []
    if launch.layout.parallelism.pipelined:  # the whole model's files, gathered on the main process's host memory
        whole = ParamCounts.of(config).total
        state = launch.optimizer_spec.state_bytes_of(whole, ParamCounts.of(config).block_matrices)
        gathered = [Item("gathered whole model", (4 * whole + state)
                         if host else 0, "weights and optimizer state of every stage, on the main process"
                         + ("" if host else " (host memory)"))]
    phases["checkpoint save"] = kept + [evaluation(1, T, "the health check: one window")] + gathered
    settings["checkpoint save"] = "the weights themselves"
    exported = ParamCounts.of(config) if launch.layout.parallelism.pipelined else counts  # what the main process writes
    transposed = Item("export's transposed matrices", 4 * exported.block_matrices if host else 0,
                      "GPT-2's Conv1D layout in the file" + ("" if host else " (host memory)"))
    phases["export"] = [i for i in kept if i.name != "optimizer state"] + [transposed] + \
        [replace(i, bytes=4 * ParamCounts.of(config).total if host else 0) for i in gathered]
    settings["export"] = "the weights themselves"
    if run.hub_staging:
        loaded = Item("staged checkpoint", 4 * counts.total if host else 0, "loaded into a model on the main process"
                      + ("" if host else " (host memory)"))
        phases["Hub staging"] = kept + [loaded, transposed]
        settings["Hub staging"] = "--hub_push_every 0 (stage only the final model)"
    return RunPlan(step, phases, settings)



def format_gib(n: int) -> str:
    return f"{n / GiB:.3f} GiB" if n < GiB / 10 else f"{n / GiB:.2f} GiB"
