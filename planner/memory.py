"""How much memory one training process needs, computed from the model's shapes: the memory planner.

`plan_memory(GPTConfig, Launch)` adds up what one step holds per device, by item and by moment. `plan_run` plans
each phase of a run beside the step. Everything here is arithmetic: nothing is allocated or measured.
docs/engines.md ("How the planner counts") derives each item's bytes. `benchmarks/memory_plan.py` is the command
line; `python train.py ... --plan` prints a run's plan (`exit_after_plan`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from common.errors import UserError
from common.parallelism import Parallelism
from configs import EvalConfig
from model.config import GPTConfig
from model.loss import KERNEL_DEVICE_TYPE, LOSS_CHUNK_ROWS
from model.pipeline import stage_blocks
from model.tensor_parallel import split_problem
from planner.launch import GiB, Launch
from training.evaluations.registry import EVALUATIONS
from training.evaluations.spec import EvaluationSpec

# A CPU process's RSS with torch and the project imported, after one tiny step: its thread pools and workspaces.
# Measured on docs/benchmarks.md's 2-core EPYC, torch 2.13. `memory_plan.py --validate` measures it in each process.
CPU_PROCESS_BYTES = int(0.31 * GiB)
# Kept free on a CUDA device when judging a fit. The context takes ~0.5 GiB, ~1 GiB with NCCL's buffers.
# The caching allocator's fragmentation (cached blocks not reusable at another size) takes 10% of the peak.
CUDA_CONTEXT_BYTES = GiB
ALLOCATOR_SLACK = 0.10
# A train.py process's RSS on the CPU beside its tensors: torch, accelerate, the tokenizer, data and evaluations.
# benchmarks/bench_run_memory.py measured it: the RSS between phases less the parameters and AdamW's state.
# 0.45 GiB for GPT-2 124M and `small` alike (2-core EPYC, torch 2.13). Evaluations add their own
# (`EvaluationSpec.cpu_process_bytes`).
TRAIN_PROCESS_BYTES = int(0.45 * GiB)
# DeepSpeed's default reduce_bucket_size, in elements: ZeRO-1 and 2 reduce the gradients through buckets this large.
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000
# The name of the chunked loss's logits buffer where a CPU step holds it (`_held_logits_bytes`).
HELD_LOGITS = "loss logits buffer"



@dataclass(frozen=True)
class ParamCounts:
    """The model's parameters by where they go (a tied weight once)."""

    block_matrices: int  # the blocks' 2-D weights (Muon's, with --optimizer muon)
    block_vectors: int  # the blocks' biases and LayerNorm weights
    embeddings: int  # token (padded vocabulary, tied to the head) and position embeddings
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
        """What pipeline stage `stage` holds (`model.pipeline`): its blocks. The first also holds the embeddings.
        The last holds ln_f and the tied output layer's copy of the token embedding."""
        whole, stages = cls.of(config), parallelism.pipeline_parallel
        share = len(stage_blocks(config.n_layer, stages)[stage]) / config.n_layer
        first, last = stage == 0, stage == stages - 1
        wte = config.padded_vocab_size * config.n_embd
        return cls(block_matrices=round(whole.block_matrices * share), block_vectors=round(whole.block_vectors * share),
                   embeddings=(whole.embeddings if first else 0) + (wte if last and not first else 0),
                   final_norm=whole.final_norm if last else 0)

    @classmethod
    def per_rank(cls, config: GPTConfig, parallelism: Parallelism) -> ParamCounts:
        """What one rank of a tensor-parallel group holds (`model.tensor_parallel`'s plan). It holds 1/degree of the
        blocks' matrices and of the column-wise biases (c_attn's 3C, c_fc's 4C), the rest whole."""
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
    stage: int | None = None  # the pipeline stage planned (the fuller one); None without a pipeline

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
    """What one Block saves for its backward, in bytes (docs/engines.md lists each tensor)."""
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
    """Bytes of a parameter as the forward uses it. FSDP2 all-gathers bf16 copies (accelerate's
    MixedPrecisionPolicy(param_dtype=bf16)); otherwise it is the fp32 parameter itself."""
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
    if (buffer := _held_logits_bytes(config, launch, share)):
        held.append(Item(HELD_LOGITS, buffer, "the loss walk's fp32 chunk, which a CPU process keeps"))
    return held


def _held_logits_bytes(config: GPTConfig, launch: Launch, share: _Share) -> int:
    """The chunked loss's fp32 logits buffer, which the walk keeps between steps on a CPU (`model.loss`)."""
    if launch.device != "cpu" or not launch.loss_rows or not share.last:
        return 0
    return 4 * min(launch.micro_batch_size * config.block_size, launch.loss_rows) * config.padded_vocab_size


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
    """The loss's item at the forward's end and at the backward's start, on the launch's path.

    Only the last stage computes the loss."""
    if not share.last:
        return [], []
    B, T, C, V = launch.micro_batch_size, config.block_size, config.n_embd, config.padded_vocab_size
    btc, bf16 = B * T * C, launch.dtype == "bf16"
    if launch.loss_rows:  # the chunked loss
        weight_grad = (2 if launch.bf16_parameters else 4) * V * C  # the loss's output-layer gradient, in wte's dtype
        rows = min(B * T, launch.loss_rows)
        scaled = [Item("loss (chunked)", 8 * btc + 2 * weight_grad, "its two gradients, scaled")]
        if launch.device == KERNEL_DEVICE_TYPE:  # model.loss_kernel: the logits in the matmul's dtype, in place
            low = 2 if bf16 else 4
            # The chunk's logits and its weight-gradient product in the matmul's dtype; under autocast also the
            # weight cast once, and the chunk's rows and their gradient in bf16.
            temps = low * V * C + (2 * V * C + 4 * rows * C if bf16 else 0)
            return ([Item("loss (chunked)", low * rows * V + 8 * btc + weight_grad + temps,
                          f"a {rows} x {V} {'bf16' if bf16 else 'fp32'} logits chunk (one Triton kernel), its "
                          "gradients")], scaled)
        autocast_temps = 2 * rows * V + 2 * V * C if bf16 else 0  # bf16 logits and weight-gradient products
        fresh = 4 * rows * V - _held_logits_bytes(config, launch, share)  # on a CPU the buffer is held instead
        return ([Item("loss (chunked)", fresh + 8 * btc + weight_grad + autocast_temps,
                      f"a {rows} x {V} fp32 logits buffer" + (" (held)" if not fresh else "") + ", its gradients")],
                scaled)
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
    """What the optimizer step holds: the weights, their gradients and state, the engine's buckets, Muon's work.

    On a CPU, AdamW's for-loop temporaries and the loss's held logits buffer too."""
    buckets = [i for i in held if i.name in ("DDP gradient buckets", "DeepSpeed reduce buckets", HELD_LOGITS)]
    temporaries = [Item("step temporaries", 2 * 4 * config.padded_vocab_size * config.n_embd
                        // launch.shards.optimizer_state,
                        "AdamW's for-loop on the CPU: 2 copies of the largest parameter")] \
        if launch.device == "cpu" else []
    return [*weights, *buckets, *_whole_matrix(config, launch), *_stacked_newton_schulz(config, launch, share.layers),
            *temporaries]



def _whole_matrix(config: GPTConfig, launch: Launch) -> list[Item]:
    """Muon's working set where the matrices are DTensors (FSDP2, tensor parallelism) or under ZeRO.

    It is the largest matrix, gathered whole, and Newton-Schulz's 4 working copies of it (docs/engines.md)."""
    zero = launch.layout.one_client_optimizer
    if not launch.optimizer_spec.whole_matrices or not (launch.layout.dtensor_matrices or zero):
        return []
    largest = 4 * config.n_embd * config.n_embd
    return [Item("Muon's whole matrix", 4 * 5 * largest, "the largest matrix orthogonalised whole by DeepSpeed's Muon, "
                 "and 4 working copies" if zero else "the largest matrix gathered for Newton-Schulz, and 4 working "
                 "copies")]


def _stacked_newton_schulz(config: GPTConfig, launch: Launch, layers: int) -> list[Item]:
    """Muon's working set on whole matrices (one process, DDP, a pipeline stage): one shape's matrices at once.

    A rank orthogonalises its share of the `layers` matrices, then gathers the rest. The plan is the larger of
    the iteration and the gather (docs/engines.md, "How the planner counts")."""
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
    """This process's parameters, gradients and optimizer state, each split as `launch.shards` says.

    They are fp32. With an fp32 master copy (DeepSpeed's bf16) the module's are bf16, and the optimizer keeps it."""
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
    """What a run does besides its steps, as far as memory goes: train.py's evaluation and saving settings."""

    eval_batch_size: int  # validation windows (of block_size tokens) or HellaSwag items per evaluation forward
    # The registered evaluations that run (`training.evaluations`), in the registry's order. Validation always runs.
    evaluations: tuple[str, ...] = ("validation",)
    hub_staging: bool = False  # --push_to_hub with --hub_push_every: checkpoints converted on the main process

    def __post_init__(self) -> None:
        if self.eval_batch_size < 1:
            raise UserError(f"--eval_batch_size must be positive, got {self.eval_batch_size}; pass at least 1")
        if unknown := set(self.evaluations) - set(EVALUATIONS):
            raise UserError(f"no evaluation named {', '.join(sorted(unknown))}; plan {', '.join(EVALUATIONS)}")

    @classmethod
    def of_flags(cls, cfg: EvalConfig, parsed: Mapping[str, Any] | None = None, hub_staging: bool = False
                 ) -> RunPhases:
        """The phases a run with these evaluation flags goes through. `cfg` is the shared group. Each evaluation's
        own flags are among `parsed` (`TrainConfig.added`); without them, their defaults."""
        parsed = parsed or {}
        return cls(cfg.eval_batch_size, tuple(name for name, spec in EVALUATIONS.items()
                                              if spec.every(spec.flags_in(parsed))), hub_staging)

    @property
    def specs(self) -> list[EvaluationSpec]:
        return [EVALUATIONS[name] for name in EVALUATIONS if name in self.evaluations]



@dataclass(frozen=True)
class RunPlan:
    """What one process holds at each phase's peak: the step, each evaluation, a checkpoint save, the export.

    The run's peak is the largest phase's; `phase` names it. `settings` names the flag that lowers each phase."""

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
    """What a no-grad evaluation forward of `rows` x `tokens` adds to what the process holds.

    It is the larger of a block's live tensors and the chunked loss's working set (docs/engines.md)."""
    a = 2 if launch.dtype == "bf16" else 4
    btc = rows * tokens * config.n_embd
    block = btc * (2 * 4 + 13 * a)
    loss = 4 * min(rows * tokens, LOSS_CHUNK_ROWS) * config.padded_vocab_size + 4 * config.padded_vocab_size * \
        config.n_embd + 4 * 4 * btc
    return max(block, loss)



def run_process_bytes(launch: Launch, run: RunPhases) -> int:
    """train.py's own RSS beside its tensors on a CPU: `TRAIN_PROCESS_BYTES` plus each evaluation's share.

    0 on CUDA, where the process's host memory is not the device's."""
    return TRAIN_PROCESS_BYTES + sum(spec.cpu_process_bytes for spec in run.specs) if launch.device == "cpu" else 0


def plan_run(config: GPTConfig, launch: Launch, run: RunPhases) -> RunPlan:
    """The peak of each phase of a run of `config` under `launch` (see `RunPlan`).

    Between steps a process keeps its weights, the optimizer state and DDP's buckets. Each phase adds to that.
    docs/engines.md ("How the planner counts") says what each adds. On a CPU each phase counts train.py's own RSS
    (`TRAIN_PROCESS_BYTES`), and what each evaluation it scores adds (`cpu_process_bytes`)."""
    process = run_process_bytes(launch, run)
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
    if launch.layout.parallelism.pipelined:  # the whole model's files, gathered in the main process's host memory
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
