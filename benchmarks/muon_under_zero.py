"""How far DeepSpeed's own Muon under ZeRO-2 lands from this project's Muon on one process (a measurement, not a
timing): the reason `--optimizer muon` runs under ZeRO with `--grad_clip 0` only (training/optimizers/muon.py,
`SPEC.refused_under`; with it, train.py runs DeepSpeed's Muon: training/optimizers/muon_deepspeed.py).

    torchrun --nproc_per_node 2 -m benchmarks.muon_under_zero --steps 10 [--zero_stage 1|2|3]

Both sides train the same tiny GPT (2 blocks, 32 wide, the GPT-2 vocabulary; fp32) on the same batches (8 sequences
of 32 random tokens a step; each of the 2 ranks takes its half) from the same initial weights, at the project's
default learning rates held constant (Muon 0.02, momentum 0.95; AdamW 1e-2, betas (0.9, 0.95), weight decay 0.1 on
the >= 2-D tensors):
- the reference, on rank 0 alone: `training.optimizers.plan.build_optimizer` (torch's AdamW and our `Muon`,
torch.optim.Muon's
  step), the whole batch, `clip_grad_norm_(--grad_clip)` on the raw gradients, then both steps: what train.py runs;
- DeepSpeed: `deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam` as the client optimizer of a ZeRO-2 engine
  on 2 gloo processes, the same parameter groups (Muon on the blocks' matrices, tagged `use_muon`; torch's AdamW as
  its auxiliary optimizer with the same groups), DeepSpeed's `gradient_clipping` = --grad_clip.

Four variants, each printed as the distance of the final weights from the reference's, relative to the reference's
move from the initial weights (all tensors together, and the worst tensor), so that float rounding reads as ~1e-6
(fp32 Newton-Schulz) or ~1e-2 (bf16):
- `shipped`: DeepSpeed's defaults (`ns_method` "gram": fp16 where the CPU multiplies fp16, else fp32) against ours
  (bf16 Newton-Schulz where the CPU has bf16 units, else fp32;
  `training.optimizers.muon_optimizer.newton_schulz_dtype`);
- `standard`: `ns_method` "standard" (DeepSpeed's torch-like iteration, bf16 on every CPU) against ours in bf16;
- `fp32`: both iterations in float32 (DeepSpeed's `ns_compute_dtype` patched), clipping as configured;
- `fp32-noclip`: both in float32, no clipping on either side: what is left is the optimizers' own arithmetic.
"""
from __future__ import annotations

import argparse
import importlib
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # DeepSpeed wraps Newton-Schulz in torch.compile: eager, as ours
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from configs import ModelConfig, OptimConfig  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from training.optimizers.plan import build_optimizer, plan_optimizers  # noqa: E402
from training.optimizers.spec import BLOCK_MATRICES, claimed_names  # noqa: E402

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.0)
BATCH = 8
VARIANTS = ("shipped", "standard", "fp32", "fp32-noclip")


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size), generator=g),
             torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size), generator=g)) for _ in range(steps)]


def fresh_model() -> GPT:
    torch.manual_seed(1337)
    return GPT(CONFIG)


def plan():
    return plan_optimizers(OptimConfig(optimizer="muon", lr=1e-2), ModelConfig())


def reference(steps: int, grad_clip: float, ns_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    model = fresh_model()
    optimizers = build_optimizer(model, plan(), "cpu")
    if ns_dtype is not None:
        optimizers[1].ns_dtype = ns_dtype
    for x, y in batches(steps):
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def deepspeed_run(steps: int, grad_clip: float, ns_method: str, stage: int) -> dict[str, torch.Tensor]:
    import deepspeed
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    model = fresh_model()
    p = plan()
    named = dict(model.named_parameters())
    muon_names = set(claimed_names(model, BLOCK_MATRICES))
    for name, param in named.items():
        param.use_muon = name in muon_names
    rest = [param for name, param in named.items() if name not in muon_names]
    groups = [
        {"params": [named[n] for n in sorted(muon_names)], "use_muon": True, "lr": p.flags.muon_lr,
         "momentum": p.flags.muon_momentum, "weight_decay": p.flags.muon_weight_decay, "ns_method": ns_method},
        {"params": [q for q in rest if q.dim() >= 2], "use_muon": False, "lr": p.lr, "betas": p.betas, "eps": 1e-8,
         "weight_decay": p.weight_decay},
        {"params": [q for q in rest if q.dim() < 2], "use_muon": False, "lr": p.lr, "betas": p.betas, "eps": 1e-8,
         "weight_decay": 0.0},
    ]
    optimizer = MuonWithAuxAdam(groups, adam_optimizer=torch.optim.AdamW)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    zero = {"stage": stage, **({"reduce_scatter": False} if stage == 3 else {})}  # ZeRO-3's Muon: no reduce-scatter
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": BATCH // world, "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip, "zero_optimization": zero, "steps_per_print": 10 ** 9})
    share = BATCH // world
    for x, y in batches(steps):
        loss = engine(x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])[1]
        engine.backward(loss)
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # ZeRO-3's partitions, whole
        return {n: q.detach().clone() for n, q in engine.module.named_parameters()}


def distance(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> tuple[float, float, str]:
    """(all tensors' distance / all tensors' move, the worst tensor's, its name)."""
    start = dict(fresh_model().named_parameters())
    moved = torch.stack([(ours[n] - start[n]).norm() for n in ours]).norm()
    apart = torch.stack([(theirs[n] - ours[n]).norm() for n in ours]).norm()
    worst = max(ours, key=lambda n: ((theirs[n] - ours[n]).norm() / (ours[n] - start[n]).norm()).item())
    ratio = ((theirs[worst] - ours[worst]).norm() / (ours[worst] - start[worst]).norm()).item()
    return (apart / moved).item(), ratio, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--grad_clip", type=float, default=1.0, help="train.py's default --grad_clip")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--zero_stage", type=int, default=2, choices=(1, 2, 3))
    args = parser.parse_args()

    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo does the collectives
    deepspeed.init_distributed(dist_backend="gloo")
    original = importlib.import_module("deepspeed.runtime.zero.muon.original_muon")
    shipped_dtype = original.ns_compute_dtype
    rank = torch.distributed.get_rank()
    for variant in args.variants.split(","):
        fp32 = variant.startswith("fp32")
        clip = 0.0 if variant == "fp32-noclip" else args.grad_clip
        original.ns_compute_dtype = (lambda method="gram": torch.float32) if fp32 else shipped_dtype
        ns_method = "gram" if variant == "shipped" else "standard"
        theirs = deepspeed_run(args.steps, clip, ns_method, args.zero_stage)
        if rank == 0:
            ours = reference(args.steps, clip if clip > 0 else float("inf"),
                             torch.float32 if fp32 else torch.bfloat16 if variant == "standard" else None)
            whole, worst, name = distance(ours, theirs)
            print(f"ZeRO-{args.zero_stage} {variant:12s} ns {ns_method:8s} ({original.ns_compute_dtype(ns_method)}) "
                  f"clip {clip:g}: {args.steps} steps, apart {whole:.3g} of the move (worst {worst:.3g}, {name})",
                  flush=True)
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
