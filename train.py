"""Train a GPT on Accelerate: the same script on a laptop CPU, one GPU, 8xH100 or several nodes.

    python train.py                                   # small GPT on Tiny Shakespeare, CPU-friendly
    accelerate launch --config_file accelerate_configs/8gpu.yaml train.py \
        --config configs/gpt2_124m_fineweb_edu.yaml   # GPT-2 124M on FineWeb-Edu 10B

Precision (bf16), torch.compile (dynamo backend), the number of processes and FSDP come from the
accelerate config; everything about the run comes from `configs.TrainConfig` (preset + flags).
"""
from __future__ import annotations

import gc
import math
import os
import secrets
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
import yaml
from accelerate import Accelerator, PartialState
from accelerate.utils import ProjectConfiguration, set_seed
from tqdm.auto import tqdm

from common.errors import UserError, run_cli
from common.run_dir import RunDir
from configs import TrainConfig, parse_config
from data import get_tokenizer
from data.loader import build_train_loader, load_val_tokens
from eval.val_loss import evaluate_loss
from model import GPT, GPTConfig
from training.checkpoint import ResumePoint, find_resume_point, load_checkpoint, save_checkpoint
from training.metrics import MetricsLog, trackers_for
from training.mfu import estimate_mfu, peak_flops
from training.preemption import PreemptionFlag


def accumulation_steps(cfg: TrainConfig, world_size: int) -> int:
    """Micro-steps per optimizer step so that micro * block * processes * steps == total_batch_size."""
    per_micro_step = cfg.micro_batch_size * cfg.block_size * world_size
    if cfg.total_batch_size % per_micro_step:
        raise UserError(
            f"total_batch_size {cfg.total_batch_size} is not a multiple of micro_batch_size x block_size x processes "
            f"= {cfg.micro_batch_size} x {cfg.block_size} x {world_size} = {per_micro_step}; change one of them"
        )
    return cfg.total_batch_size // per_micro_step


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at `max_steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


def train_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]], grad_accum: int, lr: float,
               grad_clip: float) -> tuple[torch.Tensor, float]:
    """One optimizer step: `grad_accum` micro-steps, clip, AdamW update (skipped when the norm is not
    finite). Returns the summed micro-batch losses (on device) and the global gradient norm."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    device = accelerator.device
    loss_sum = torch.zeros((), device=device)
    for _ in range(grad_accum):
        x, y = next_batch()
        with accelerator.accumulate(model):  # all-reduces gradients only on the last micro-step
            _, loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            accelerator.backward(loss)  # divides by grad_accum: the step's gradient is the mean
        loss_sum += loss.detach()
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip)  # global norm, same on all ranks
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


def model_config(cfg: TrainConfig, checkpoint: ResumePoint | None) -> GPTConfig | None:
    """The architecture this run trains, or None when it comes from `init_from` weights."""
    if cfg.init_from == "scratch":
        return GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
                         dropout=cfg.dropout, bias=cfg.bias)
    if checkpoint is not None:  # fine-tuning run being resumed: the checkpoint's weights replace init_from's
        return GPTConfig(**{**checkpoint.gpt_config, "block_size": cfg.block_size, "dropout": cfg.dropout})
    return None


def check_out_dir(cfg: TrainConfig) -> None:
    """Never train over someone's checkpoints or final model by accident."""
    run = RunDir(cfg.out_dir)
    if cfg.resume is None and (run.latest_checkpoint() is not None or run.final.exists()):
        raise UserError(f"{run.path} already holds a run; pass --resume latest to continue it or choose another --out_dir")


def sample(model: GPT, cfg: TrainConfig, device: torch.device) -> str:
    """A short sample from a fixed seed, drawn without disturbing the training RNG streams."""
    enc = get_tokenizer()
    prompt = torch.tensor([enc.encode(cfg.sample_prompt, allowed_special="all")], device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed)
        out = model.generate(prompt, max_new_tokens=cfg.sample_tokens, temperature=1.0, top_k=200)
    return enc.decode(out[0].tolist())


def main() -> None:
    cfg = parse_config()
    # A multi-process launch on a machine without CUDA runs on gloo; otherwise every process would be rank 0.
    cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    state = PartialState(cpu=cpu)  # knows the world size before the Accelerator needs the accumulation count
    grad_accum = accumulation_steps(cfg, state.num_processes)
    check_out_dir(cfg)
    checkpoint = find_resume_point(cfg.resume, cfg.out_dir)
    if cfg.push_to_hub:  # a missing token should fail now, not after hours of training
        from publish.hub import check_hub_access
        check_hub_access(cfg.hub_model_id)

    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=grad_accum, log_with=trackers_for(cfg.report_to),
                              project_config=ProjectConfiguration(cfg.out_dir, logging_dir=f"{cfg.out_dir}/tensorboard"))
    device, main_process = accelerator.device, accelerator.is_main_process
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    set_seed(cfg.seed)  # identical initial weights on every rank
    out_dir = Path(cfg.out_dir)

    # The model, its optimizer (AdamW, decay on >=2-D weights, fused on CUDA), and accelerate's wrapping.
    arch = model_config(cfg, checkpoint)
    model = GPT(arch) if arch is not None else GPT.from_pretrained(cfg.init_from, block_size=cfg.block_size,
                                                                   dropout=cfg.dropout)
    arch = model.config
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2), device.type)
    flops_per_token = model.flops_per_token()
    peak = peak_flops(device, cfg.mfu_peak_flops)
    model, optimizer = accelerator.prepare(model, optimizer)  # no scheduler: the LR is computed from the step
    torch.manual_seed(cfg.seed + accelerator.process_index)  # from here on, each rank draws its own dropout masks

    # Data: every rank reads its own rows of the same global batches; validation is one fixed token set.
    rank, world = accelerator.process_index, accelerator.num_processes
    train_loader = build_train_loader(cfg.dataset, block_size=cfg.block_size, micro_batch_size=cfg.micro_batch_size,
                                      rank=rank, world_size=world, text_column=cfg.text_column,
                                      dataset_config=cfg.dataset_config, seed=cfg.seed)
    val_tokens = load_val_tokens(cfg.dataset, max_tokens=cfg.val_tokens, text_column=cfg.text_column,
                                 dataset_config=cfg.dataset_config)
    hellaswag_items = None
    if cfg.hellaswag_every:
        from eval.hellaswag import evaluate_hellaswag, load_items
        hellaswag_items = load_items(cfg.hellaswag_data, cfg.hellaswag_limit)

    # Resume: weights, optimizer, RNG, accumulation step, data position and the tracker's run id.
    step, tokens, run_id = 0, 0, secrets.token_hex(4)
    if checkpoint is not None:
        train_loader.load_state_dict(load_checkpoint(accelerator, checkpoint, arch))
        run_state = checkpoint.run_state
        step, tokens, run_id = run_state["step"], run_state["tokens"], run_state["run_id"]
        accelerator.print(f"resumed from {checkpoint.path} at step {step} ({tokens:,} tokens)")
    elif cfg.resume:
        accelerator.print(f"no checkpoint in {out_dir} yet: starting a new run")
    if main_process:  # only now: a resume that was refused must leave the run folder untouched
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(asdict(cfg), sort_keys=False))
    accelerator.init_trackers(cfg.wandb_project, config=asdict(cfg),
                              init_kwargs={"wandb": {"id": run_id, "resume": "allow", "name": cfg.run_name or out_dir.name,
                                                     "dir": str(out_dir)}})
    metrics = MetricsLog(accelerator, out_dir, resume_step=step)
    preempted = PreemptionFlag()
    accelerator.print(f"GPT {accelerator.unwrap_model(model).num_params() / 1e6:.2f}M params | {world} process(es) x "
                      f"{grad_accum} accumulation x {cfg.micro_batch_size} x {cfg.block_size} = {cfg.total_batch_size:,} "
                      f"tokens per step | distributed: {accelerator.distributed_type.value} | precision: "
                      f"{accelerator.mixed_precision} | {device}")

    def save(at_step: int) -> None:
        save_checkpoint(accelerator, RunDir(out_dir), at_step, {"tokens": tokens, "run_id": run_id},
                        train_loader.state_dict(), arch, cfg.keep_last)

    def evaluate(at_step: int, val: bool, hellaswag: bool) -> dict[str, float]:
        """Validation loss (+ a sample) and/or HellaSwag, on every rank (FSDP forwards need all of them)."""
        # No-grad passes need neither DDP nor torch.compile (whose graphs would recompile for every eval
        # shape); FSDP2 shards the module in place, so its gathers still run.
        plain = accelerator.unwrap_model(model, keep_torch_compile=False)
        bf16 = accelerator.mixed_precision == "bf16"
        plain.eval()
        results, text = {}, None
        if val:
            results["val_loss"] = evaluate_loss(plain, val_tokens, block_size=cfg.block_size,
                                                batch_size=cfg.eval_batch_size, accelerator=accelerator, bf16=bf16)
            text = sample(plain, cfg, device)
        if hellaswag:
            scores = evaluate_hellaswag(plain, hellaswag_items, batch_size=cfg.eval_batch_size,
                                        accelerator=accelerator, bf16=bf16)
            results.update(hellaswag_acc=scores["acc"], hellaswag_acc_norm=scores["acc_norm"])
        plain.train()
        if main_process:
            bar.write(f"step {at_step}: " + " ".join(f"{k} {v:.4f}" for k, v in results.items())
                      + (f"\n---\n{text}\n---" if text is not None else ""))
        return results

    bar = tqdm(total=cfg.max_steps, initial=step, disable=not main_process, unit="step", dynamic_ncols=True)
    train_seconds, steps_timed = 0.0, 0  # training time since the last log line (evals and saves excluded)
    uploads: list[threading.Thread] = []  # the --hub_push_every upload in flight, if any
    model.train()
    while step < cfg.max_steps:
        t0 = time.perf_counter()
        lr = learning_rate(cfg, step)
        loss_sum, grad_norm = train_step(accelerator, model, optimizer, train_loader.next_batch, grad_accum, lr,
                                         cfg.grad_clip)
        if not math.isfinite(grad_norm):  # train_step did not apply this update
            if cfg.on_nan == "stop":
                last = RunDir(out_dir).latest_checkpoint()
                raise UserError(f"non-finite loss/gradient norm at step {step + 1}; last good checkpoint: {last}. "
                                "Lower --lr or resume with --on_nan skip")
            accelerator.print(f"step {step + 1}: non-finite gradient norm, step skipped (--on_nan skip)")
        step += 1
        tokens += cfg.total_batch_size
        train_seconds += time.perf_counter() - t0
        steps_timed += 1
        bar.update(1)

        last = step == cfg.max_steps
        record = {}
        if step % cfg.log_every == 0 or last:
            loss_value = accelerator.reduce(loss_sum / grad_accum, reduction="mean").item()
            tok_per_sec = cfg.total_batch_size * steps_timed / train_seconds
            train_seconds, steps_timed = 0.0, 0
            record = {"loss": loss_value, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                      "tok_per_sec": tok_per_sec, "mfu": estimate_mfu(flops_per_token, tok_per_sec, world, peak)}
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tok_per_sec:,.0f}")
        val_due = step % cfg.eval_every == 0 or last
        hellaswag_due = hellaswag_items is not None and (step % cfg.hellaswag_every == 0 or last)
        if val_due or hellaswag_due:
            record.update(evaluate(step, val_due, hellaswag_due))
        if record:
            metrics.log(step, record)
        if step % cfg.save_every == 0 or last:
            save(step)
            if cfg.push_to_hub and cfg.hub_push_every and main_process and step % (cfg.save_every * cfg.hub_push_every) == 0:
                # In a thread: the other ranks would otherwise wait for the upload in their next collective
                # (and time out on a slow link). One upload at a time; the branch gets this checkpoint.
                for upload in uploads:
                    upload.join()
                uploads[:] = [threading.Thread(target=push, args=(cfg, f"step-{step}"), name=f"push-step-{step}")]
                uploads[0].start()
        if preempted.any_rank(accelerator):
            if step % cfg.save_every and not last:
                save(step)
            accelerator.print(f"signal received: checkpoint saved at step {step}; continue with --resume latest")
            break
    bar.close()

    finished = step == cfg.max_steps
    if finished:
        export_final(accelerator, model, arch, out_dir)
    # Orderly shutdown: two gloo processes that exit with live tensors and an open group abort now and then.
    accelerator.wait_for_everyone()
    del model, optimizer
    gc.collect()
    accelerator.end_training()
    for upload in uploads:
        upload.join()
    if finished and cfg.push_to_hub and main_process:
        push(cfg)  # after the process group is gone, so no rank sits in a collective timeout during the upload


def export_final(accelerator: Accelerator, model: torch.nn.Module, arch: GPTConfig, out_dir: Path) -> None:
    """Write `final/` in Hugging Face format (gathered from every rank under FSDP), atomically."""
    # Full weights on the main process (gathered under FSDP); a compiled model's keys carry `_orig_mod.`.
    state_dict = {k.replace("_orig_mod.", ""): v for k, v in accelerator.get_state_dict(model).items()}
    if accelerator.is_main_process:
        export = GPT(arch)
        export.load_state_dict(state_dict)
        tmp, final = out_dir / ".tmp-final", out_dir / "final"
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an export that crashed
        export.save_pretrained(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        accelerator.print(f"final model written to {final}")


def push(cfg: TrainConfig, revision: str | None = None) -> None:
    """Publish the run (main process); a failed push leaves the run intact and prints how to retry."""
    from publish.hub import push_to_hub
    try:
        print(f"pushed to {push_to_hub(cfg.out_dir, cfg.hub_model_id, revision=revision)}")
    except UserError as err:
        print(f"warning: {err}")


if __name__ == "__main__":
    run_cli(main)
