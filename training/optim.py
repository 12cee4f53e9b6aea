"""The optimizers a run trains with, built from the model's parameters and the run's config.

`--optimizer adamw`: one AdamW over every parameter. `--optimizer muon`: torch.optim.Muon on the 2-D weight
matrices inside the transformer blocks (attention and MLP projections), AdamW on everything else (token and
position embeddings, the output layer tied to the token embedding, biases, LayerNorms): Muon orthogonalises a
matrix's update, which suits hidden layers only, and torch's Muon takes 2-D parameters only.

`--optimizer auto` is resolved once, into an `OptimizerPlan`: Muon to train from scratch (tuned and measured
here: docs/benchmarks.md), AdamW to fine-tune weights that AdamW trained and for LoRA adapters (low-rank
factors, not hidden matrices).

Muon is `Muon` below: torch.optim.Muon whose Newton-Schulz orthogonalisation runs in the dtype the device
multiplies fast (`newton_schulz_dtype`), not always in bfloat16 as torch's does: a CPU without bf16 matrix units
multiplies bf16 matrices 10x slower than fp32 ones.

Invariants: every trainable parameter is in exactly one optimizer (a tied weight once); the list's first
optimizer is always the AdamW (accelerate saves it as `optimizer.bin`, a second one as `optimizer_1.bin`);
`plan.names` names them in that order (checkpoints record it); the learning rates of step s are
`plan.lrs_at(schedule.factor(s))`, one per optimizer, in that order.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch

from configs import ModelConfig, OptimConfig
from configs.schema import DEFAULT_LRS
from training.engines import full_numel


@dataclass(frozen=True)
class OptimizerPlan:
    """The run's optimizers, resolved from `--optimizer` and the job: what trains with what, at which peak LR."""

    kind: str  # "adamw" (every parameter) or "muon" (Muon on the blocks' matrices, AdamW on the rest)
    job: str  # what trains: a key of configs.schema.DEFAULT_LRS ("LoRA", "full fine-tuning", ...)
    lr: float  # AdamW's peak learning rate: --lr, else the job's default
    lr_is_default: bool  # no --lr was given
    muon_lr: float  # Muon's peak learning rate (kind "muon" only)
    weight_decay: float
    betas: tuple[float, float]
    muon_momentum: float
    muon_weight_decay: float

    @property
    def names(self) -> tuple[str, ...]:
        """The optimizers `build_optimizer` returns, in order: ("adamw",) or ("adamw", "muon")."""
        return ("adamw", "muon") if self.kind == "muon" else ("adamw",)

    def lrs_at(self, factor: float) -> list[float]:
        """Each optimizer's learning rate when the schedule is at `factor` of the peak (one per optimizer)."""
        return [self.lr * factor] + ([self.muon_lr * factor] if self.kind == "muon" else [])


def plan_optimizers(cfg: OptimConfig, model: ModelConfig) -> OptimizerPlan:
    """`--optimizer` resolved for what trains (`auto`: Muon to train from scratch, AdamW to fine-tune or for LoRA),
    and AdamW's learning rate: `--lr`, else the default of the job (configs.schema.DEFAULT_LRS)."""
    kind = cfg.optimizer if cfg.optimizer != "auto" else ("muon" if model.from_scratch else "adamw")
    if model.from_scratch:
        job = f"from scratch with {'Muon' if kind == 'muon' else 'AdamW'}"
    else:
        job = "LoRA" if model.lora_rank else "full fine-tuning"
    lr = cfg.lr if cfg.lr is not None else DEFAULT_LRS[job]
    return OptimizerPlan(kind=kind, job=job, lr=lr, lr_is_default=cfg.lr is None, muon_lr=cfg.muon_lr,
                         weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2), muon_momentum=cfg.muon_momentum,
                         muon_weight_decay=cfg.muon_weight_decay)


def newton_schulz_dtype(device_type: str) -> torch.dtype:
    """The dtype Muon orthogonalises in on `device_type`: bfloat16 on accelerators (torch's choice: tensor cores
    multiply bf16 fastest), and on CPUs with bf16 matrix instructions (AVX-512-BF16, AMX); float32 on every other
    CPU, which has no bf16 units and emulates bf16 matmuls (a 512 x 512 one at 1.2 GFLOP/s against 16.8 in fp32 on
    a 2-core AVX2 EPYC). Decided from the hardware alone, so a resume on the same machine computes the same bits."""
    if device_type != "cpu":
        return torch.bfloat16
    capabilities = torch.cpu.get_capabilities()
    native_bf16 = capabilities.get("avx512_bf16", False) or capabilities.get("amx_bf16", False)
    return torch.bfloat16 if native_bf16 else torch.float32


def orthogonalise(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration in `dtype`: with bfloat16, bit for bit torch's own
    (the same operations in the same order); with float32, the same iteration without bf16's rounding."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:  # iterate on the wide orientation: the Gram matrix x x^T is the smaller square
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon with its orthogonalisation in `ns_dtype` (`newton_schulz_dtype`). torch's constructor,
    validation, param groups and state (one `momentum_buffer` per matrix, checkpoints interchangeable with
    torch's); `step` is torch's update, in which only the Newton-Schulz dtype is ours. The dtype is an attribute,
    not a param-group field, so it always comes from the machine that runs, also after a resume.
    Only torch's default LR adjustment (`adjust_lr_fn` "original": lr x sqrt(max(1, rows / cols))) is offered."""

    def __init__(self, params, *, ns_dtype: torch.dtype, **kwargs) -> None:
        if kwargs.get("adjust_lr_fn") not in (None, "original"):
            raise ValueError(f"adjust_lr_fn {kwargs['adjust_lr_fn']!r} is not implemented here; use None")
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalise(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                p.mul_(1 - lr * weight_decay)
                p.add_(update, alpha=-lr * math.sqrt(max(1, p.size(0) / p.size(1))))
        return loss


def muon_parameter_names(model: torch.nn.Module) -> list[str]:
    """The parameters Muon trains: the 2-D weights of the transformer blocks (`transformer.h.*`)."""
    return [name for name, p in model.named_parameters()
            if p.requires_grad and p.dim() == 2 and name.startswith("transformer.h.")]


def build_optimizer(model: torch.nn.Module, plan: OptimizerPlan, device_type: str) -> list[torch.optim.Optimizer]:
    """[AdamW] or [AdamW, Muon] (`plan.kind`). AdamW decays matrices and embeddings (>= 2-D) only, not biases
    or LayerNorm gains."""
    to_muon = set(muon_parameter_names(model)) if plan.kind == "muon" else set()
    named = dict(model.named_parameters())  # a tied weight appears once, under its first name
    adamw_params = [p for name, p in named.items() if p.requires_grad and name not in to_muon]
    groups = [
        {"params": [p for p in adamw_params if p.dim() >= 2], "weight_decay": plan.weight_decay},
        {"params": [p for p in adamw_params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # The fused CUDA kernel does the whole update in a few launches instead of one per tensor.
    fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    adamw = torch.optim.AdamW(groups, lr=plan.lr, betas=plan.betas, **({"fused": True} if fused else {}))
    if not to_muon:
        return [adamw]
    muon = Muon([named[name] for name in sorted(to_muon)], lr=plan.muon_lr, momentum=plan.muon_momentum,
                weight_decay=plan.muon_weight_decay, ns_dtype=newton_schulz_dtype(device_type))
    return [adamw, muon]


def describe_optimizers(model: torch.nn.Module, plan: OptimizerPlan) -> str:
    """Which optimizer trains which parameters, for the run's header; for Muon also the dtype it orthogonalises
    in on the device that holds the model."""
    total = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    lr = f"lr {plan.lr:g}" + (f", the default for {plan.job}" if plan.lr_is_default else "")
    if plan.kind == "adamw":
        return f"optimizer: AdamW ({lr}) on all {total / 1e6:.2f}M trainable params"
    named = dict(model.named_parameters())
    muon = sum(full_numel(named[name]) for name in muon_parameter_names(model))
    ns_dtype = str(newton_schulz_dtype(next(model.parameters()).device.type)).removeprefix("torch.")
    return (f"optimizer: Muon (lr {plan.muon_lr:g}, Newton-Schulz in {ns_dtype}) on the blocks' 2-D weights "
            f"({muon / 1e6:.2f}M params), "
            f"AdamW ({lr}) on embeddings/output layer, biases, LayerNorms ({(total - muon) / 1e6:.2f}M)")


def release_optimizer_state(optimizers: list[torch.optim.Optimizer]) -> None:
    """Free the optimizers' state (AdamW's two tensors per parameter: twice the weights) once the run's last
    checkpoint holds it: the export that follows then peaks under the training step (docs/benchmarks.md)."""
    for optimizer in optimizers:
        optimizer.state.clear()
