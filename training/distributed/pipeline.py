"""`--pipeline_parallel N`: whole blocks on different processes. W processes run W / N pipelines side by side (data
parallelism), each of N consecutive ranks; rank r holds stage r % N (`model.pipeline.GPTStage`).

An optimizer step is torch's 1F1B schedule over the step's micro-batches. The run's accumulation micro-steps are the
pipeline's micro-batches, so `--total_batch_size` keeps its meaning and the gradient is the same global mean. After
the schedule:
- the tied embedding's two copies (first stage's input, last stage's output layer) get the sum of their gradients,
  so they stay equal;
- the pipelines' gradients are averaged stage by stage, as DDP would;
- the gradient norm is the whole model's, and clipping and the non-finite rule are `training.step.train_step`'s.

accelerate prepares neither the stages nor their optimizers: its DDP would span stages that hold different
parameters. bf16 autocast comes from `accelerator.autocast()`. Evaluations call the model as they call a `GPT`; the
stages run one after another, and every rank gets the last stage's result. Checkpoints and `final/` hold the whole
model in a DDP run's files, so a pipeline checkpoint resumes under DDP, one process or another degree, and back.

On gloo the stages need static shapes and every rank's schedule needs the loss function (docs/engines.md, "What the
engines do on a CPU").
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

from common.errors import UserError
from data.tokenizer import IGNORE
from model.config import TIED, TIED_OUTPUT
from model.gpt import GPT, sample_next
from model.pipeline import GPTStage
from training.distributed.layout import Layout
from training.optimizers.spec import OptimizerPlan


class PipelineRanks:
    """This rank's stage, its pipeline's ranks, and the groups its collectives use. Every rank creates every group, in
    the same order, as torch requires."""

    def __init__(self, layout: Layout, rank: int) -> None:
        n, replicas = layout.parallelism.pipeline_parallel, layout.data_parallel_size
        self.stage, self.stages, self.replica = rank % n, n, rank // n
        pipelines = [[d * n + s for s in range(n)] for d in range(replicas)]
        self.ranks = pipelines[self.replica]
        self.group, _ = dist.new_subgroups_by_enumeration(pipelines)
        # The same stage in every pipeline: its gradients are averaged over these (None with one pipeline).
        self.replicas = replicas
        self.replica_group = dist.new_subgroups_by_enumeration(
            [[d * n + s for d in range(replicas)] for s in range(n)])[0] if replicas > 1 else None
        # The first and last stage of each pipeline: the tied embedding's two copies.
        self.tied_group = dist.new_subgroups_by_enumeration([[p[0], p[-1]] for p in pipelines])[0]

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


class PipelinedGPT(nn.Module):
    """This rank's stage of the GPT, under the whole model's parameter names: its state dict is a slice of a `GPT`'s.
    `step` trains it; evaluations call it as a `GPT` (forward, generate)."""

    def __init__(self, model: GPT, ranks: PipelineRanks, micro_batches: int, micro_batch_size: int,
                 device: torch.device) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        super().__init__()
        self.config, self.pipeline, self.micro_batches = model.config, ranks, micro_batches
        self.activation_checkpointing = model.activation_checkpointing
        stage = GPTStage(model, ranks.stage, ranks.stages).to(device)
        stage.activation_checkpointing = model.activation_checkpointing
        self.transformer = stage.transformer  # the stage's modules, under the whole model's names
        self._stage = (stage,)  # a tuple: not registered twice
        self.optimizers: list[torch.optim.Optimizer] = []  # set by `prepare`: the checkpoints save their state
        self.plan: OptimizerPlan | None = None  # set by `prepare`: how one process numbers their parameters
        T, C = model.config.block_size, model.config.n_embd
        hidden = torch.zeros(micro_batch_size, T, C, device=device)
        # Static shapes (gloo's shape inference hangs): one micro-batch in and out; activations need gradients.
        first_input = torch.zeros(micro_batch_size, T, dtype=torch.long, device=device)
        pipe_stage = PipelineStage(stage, ranks.stage, ranks.stages, device,
                                   input_args=first_input if ranks.first else hidden.clone().requires_grad_(),
                                   output_args=hidden.clone().requires_grad_(), group=ranks.group)
        self._target_scale: torch.Tensor | None = None  # a step's 1 / target count (masked targets), else None
        self._schedule = Schedule1F1B(pipe_stage, n_microbatches=micro_batches, loss_fn=self._loss, scale_grads=False)

    @property
    def stage(self) -> GPTStage:
        return self._stage[0]

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Scaled here (`scale_grads=False`): the micro-batches' losses sum to the step's mean, as in accumulation.
        # With masked targets the sum is divided by the step's target count, as `train_step` does.
        if self._target_scale is None:
            return self.stage.loss(output, target) / self.micro_batches
        return self.stage.loss(output, target, "sum") * self._target_scale

    # ---- training ---------------------------------------------------------------------------------------------

    def step(self, accelerator: Accelerator, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], lrs: Sequence[float],
             grad_clip: float, masked_targets: bool = False) -> tuple[torch.Tensor, float]:
        """One optimizer step of this pipeline over this data-parallel rank's micro-batches. Returns what
        `training.step.train_step` returns: the summed micro-batch losses (equal on the pipeline's ranks) and the
        global gradient norm. With `masked_targets` the gradient is the mean over every target of the global batch."""
        for optimizer, lr in zip(self.optimizers, lrs, strict=True):
            for group in optimizer.param_groups:
                group["lr"] = lr
        device = accelerator.device
        x = torch.cat([b[0] for b in batches]).to(device)
        y = torch.cat([b[1] for b in batches]).to(device)
        losses: list[torch.Tensor] = []
        ranks = self.pipeline
        self._target_scale = None
        if masked_targets:  # every rank of a pipeline holds the same targets: count one rank per pipeline
            count = torch.tensor(float((y != IGNORE).sum()) if ranks.first else 0.0, device=device)
            dist.all_reduce(count)
            # the pipelines' gradients are averaged (divided by their number), so multiply it back
            self._target_scale = ranks.replicas / count.clamp(min=1)
        with accelerator.autocast():
            args = (x,) if ranks.first else ()
            self._schedule.step(*args, target=y if ranks.last else None, losses=losses if ranks.last else None,
                                return_outputs=False)
        loss_sum = (torch.stack(losses).sum() * self.micro_batches).detach() if ranks.last \
            else torch.zeros((), device=device)
        dist.broadcast(loss_sum, src=ranks.ranks[-1], group=ranks.group)
        self._reduce_gradients()
        grad_norm = self._clip(grad_clip)
        for optimizer in self.optimizers:
            if math.isfinite(grad_norm):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm

    def _grads(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p.grad) for name, p in self.named_parameters() if p.grad is not None]

    def _reduce_gradients(self) -> None:
        ranks = self.pipeline
        if ranks.stages > 1 and (ranks.first or ranks.last):
            dist.all_reduce(self.transformer.wte.weight.grad, group=ranks.tied_group)
        if ranks.replica_group is not None:
            for _, grad in self._grads():
                dist.all_reduce(grad, group=ranks.replica_group)
                grad.div_(ranks.replicas)

    def _clip(self, max_norm: float) -> float:
        """The whole model's gradient norm, the tied weight counted once. Clips as torch's `clip_grad_norm_` does;
        `max_norm` 0 does not clip."""
        ranks = self.pipeline
        counted = [g for name, g in self._grads() if not (name == TIED and ranks.last and not ranks.first)]
        squares = torch.zeros((), device=self._device(), dtype=torch.float32)
        for grad in counted:
            squares += grad.detach().float().pow(2).sum()
        dist.all_reduce(squares, group=ranks.group)
        norm = squares.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for _, grad in self._grads():
                grad.mul_(coef.to(grad.dtype))
        return float(norm)

    # ---- evaluation: the stages one after another, without gradients ---------------------------------------------

    @torch.no_grad()
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, loss_reduction: str = "mean",
                **_: object) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`GPT.forward`'s (logits, loss) for evaluation, on every rank of the pipeline. Without targets, the last
        position's logits; else the loss."""
        if torch.is_grad_enabled():
            raise RuntimeError("a pipelined GPT trains through step(); its forward is for evaluation")
        ranks, stage = self.pipeline, self.stage
        B, T = idx.shape
        h = idx.to(self._device())
        if not ranks.first:
            h = torch.empty(B, T, self.config.n_embd, device=self._device())
            dist.recv(h, src=ranks.ranks[ranks.stage - 1], group=ranks.group)
        h = stage(h)
        if not ranks.last:
            dist.send(h.float().contiguous(), dst=ranks.ranks[ranks.stage + 1], group=ranks.group)
        if targets is None:
            out = stage.logits(h) if ranks.last else torch.empty(B, 1, self.config.vocab_size, device=h.device)
        else:
            shape = (B, T) if loss_reduction == "none" else ()
            out = stage.loss(h, targets.to(h.device), loss_reduction).float() if ranks.last \
                else torch.empty(shape, device=h.device)
        dist.broadcast(out, src=ranks.ranks[-1], group=ranks.group)
        return (out, None) if targets is None else (None, out)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 **_: object) -> torch.Tensor:
        """`GPT.generate` without a KV cache. Every rank draws the same tokens from the same logits and seed."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            idx = torch.cat([idx, sample_next(logits[:, -1, :], temperature, top_k).to(idx.device)], dim=1)
        return idx

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    # ---- the whole model, on the main process -----------------------------------------------------------------

    def _gather(self, part: object) -> list | None:
        """Every stage's `part` of the first pipeline, in stage order, on global rank 0 (None elsewhere)."""
        ranks = self.pipeline
        if ranks.replica != 0:
            return None
        parts = [None] * ranks.stages if dist.get_rank() == 0 else None
        dist.gather_object(part, parts, dst=0, group=ranks.group)
        return parts

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict, as a `GPT` orders it, on the main process; None elsewhere. Call on every
        rank."""
        parts = self._gather({name: t.detach().cpu() for name, t in self.state_dict().items()})
        if parts is None:
            return None
        whole = {}
        for part in parts:  # the tied weight: the first stage's copy (the last stage's is equal)
            whole.update({name: t for name, t in part.items() if name not in whole})
        with torch.device("meta"):
            order = list(GPT(self.config).state_dict())
        return {name: whole[TIED if name == TIED_OUTPUT else name] for name in order}

    def gather_whole(self) -> tuple[dict[str, torch.Tensor], list[dict[str, dict]], list[list[dict]]] | None:
        """What a DDP run's checkpoint holds, gathered from the stages on the main process: weights, optimizer states
        by name, param-group settings. None elsewhere; call on every rank."""
        weights = self.full_state_dict()
        parts = self._gather([self._state_by_name(optimizer) for optimizer in self.optimizers])
        if weights is None:
            return None
        states = []
        for index in range(len(self.optimizers)):
            by_name: dict[str, dict] = {}
            for part in parts:
                for name, state in part[index].items():
                    by_name.setdefault(name, state)
            states.append(by_name)
        settings = [[{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
                    for optimizer in self.optimizers]
        return weights, states, settings

    def load_own(self, weights: dict[str, torch.Tensor], states: list[dict[str, dict]],
                 settings: list[list[dict]], source: Path) -> None:
        """Load this stage's part of the whole model: weights, optimizer states by name, saved settings. `source`
        names the folder in the errors."""
        own = self.state_dict()
        weights.setdefault(TIED, weights.get(TIED_OUTPUT))
        if missing := [name for name in own if weights.get(name) is None]:
            raise UserError(f"{source} lacks the weight {missing[0]}; resume it with the model it was saved with")
        self.load_state_dict({name: weights[name] for name in own})
        params = dict(self.named_parameters())
        names = {id(p): name for name, p in params.items()}
        for optimizer, by_name, saved_groups in zip(self.optimizers, states, settings, strict=True):
            mine = optimizer.state_dict()
            mine_names = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
            mine["state"] = {i: by_name[name] for i, name in enumerate(mine_names) if name in by_name}
            for name in mine_names:  # a state of another shape would fail only in the next step, as a traceback
                shapes = {tuple(t.shape) for t in by_name.get(name, {}).values() if torch.is_tensor(t) and t.dim()}
                if shapes - {tuple(params[name].shape)}:
                    raise UserError(f"{source} holds an optimizer state of another shape for {name} than this "
                                    "model's; resume it with the settings it was saved with")
            for group, saved in zip(mine["param_groups"], saved_groups, strict=True):
                group.update(saved)
            optimizer.load_state_dict(mine)

    def _state_by_name(self, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
        names = {id(p): name for name, p in self.named_parameters()}
        return {names[id(p)]: {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in state.items()}
                for p, state in optimizer.state.items()}


def stage_line(model: nn.Module) -> str | None:
    """The blocks this rank's stage holds, e.g. "blocks 4-7 of 12"; None outside a pipeline."""
    if not isinstance(model, PipelinedGPT):
        return None
    blocks = model.stage.blocks
    return f"blocks {blocks.start}-{blocks.stop - 1} of {model.config.n_layer}"


def pipelined(model: GPT, layout: Layout, micro_batches: int, micro_batch_size: int,
              accelerator: Accelerator) -> nn.Module:
    """This rank's stage of `model`, or `model` itself without a pipeline. A step needs at least one micro-batch per
    stage, or 1F1B leaves stages idle."""
    n = layout.parallelism.pipeline_parallel
    if n == 1:
        return model
    if micro_batches < n:
        raise UserError(f"--pipeline_parallel {n} needs at least {n} micro-batches per step, this run has "
                        f"{micro_batches}; raise --total_batch_size or lower --micro_batch_size (the bubble is "
                        f"(stages - 1) / (micro-batches + stages - 1) of each step)", on_every_rank=True)
    return PipelinedGPT(model, PipelineRanks(layout, accelerator.process_index), micro_batches, micro_batch_size,
                        accelerator.device)

