"""The network a run trains: new from the flags, pretrained (`--init_from`), or a fine-tune being resumed.

The architecture that runs is the built model's `config`. With `--init_from` it comes from the weights, and the
architecture flags are unused. It is computed here once and the run records it; the parsed flags never change.
"""
from __future__ import annotations

import sys

from checkpoint_io.weights import Weights, resolve_weights
from common.errors import UserError, launch_rank
from configs import ModelConfig
from model import GPT, GPTConfig
from model.lora import add_adapters, check_resume, run_lora_config
from training.checkpoints.resume import ResumePoint


def build_model(cfg: ModelConfig, resume: ResumePoint | None, activation_checkpointing: bool = False,
                loss_chunk_rows: int | None = None) -> tuple[GPT, Weights | None]:
    """The network, and what `--init_from` resolved to (None from scratch).

    It comes from the flags, from `init_from`'s weights, or for a resumed fine-tune from the checkpoint's
    architecture, whose weights replace init_from's when loaded. A resumed full fine-tune downloads nothing: its
    checkpoint holds every weight. With `--lora_rank` only the adapters train (`model.lora`).
    `activation_checkpointing` and `loss_chunk_rows` set the model's own attributes; a None `loss_chunk_rows`
    resolves on the device the forward runs on, since the model is built on the CPU."""
    download = resume is None or bool(cfg.lora_rank)
    weights = None if cfg.from_scratch else resolve_weights(cfg.init_from, download=download)
    lora = run_lora_config(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_list, weights) \
        if cfg.lora_rank else None  # the adapters' settings, on the weights --init_from resolved to
    if resume is not None:
        check_resume(lora, resume.path)  # a LoRA checkpoint resumes a LoRA run only, a full one a full run
    model = _network(cfg, weights, resume)
    model.activation_checkpointing = activation_checkpointing
    model.loss_chunk_rows = loss_chunk_rows
    if (ignored := ignored_shape_flags(cfg, model.config)) and launch_rank() == 0:
        print(f"warning: {', '.join(ignored)} ignored: with --init_from {cfg.init_from} the architecture comes from "
              "the weights (the run header shows it)", file=sys.stderr, flush=True)
    if lora is not None:
        model = add_adapters(model, lora)  # only the adapters require gradients from here
    return model, weights


def ignored_shape_flags(cfg: ModelConfig, arch: GPTConfig) -> list[str]:
    """The architecture flags set to values the weights do not have. With --init_from the weights decide, and a user
    who asked for another shape should hear that it was not built."""
    if cfg.from_scratch:
        return []
    defaults = ModelConfig()
    return [f"--{name} {getattr(cfg, name)}" for name in ("n_layer", "n_head", "n_embd", "bias")
            if getattr(cfg, name) not in (getattr(arch, name), getattr(defaults, name))]


def scratch_architecture(cfg: ModelConfig) -> GPTConfig:
    """The architecture the flags describe, for a run from scratch and its memory plan."""
    return GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
                     dropout=cfg.dropout, bias=cfg.bias)


def _network(cfg: ModelConfig, weights: Weights | None, resume: ResumePoint | None) -> GPT:
    if cfg.from_scratch:
        return GPT(scratch_architecture(cfg))
    if resume is not None and not cfg.lora_rank:  # a LoRA checkpoint holds no base weights: init_from has them
        try:
            arch = GPTConfig(**{**resume.gpt_config, "block_size": cfg.block_size, "dropout": cfg.dropout})
        except (TypeError, ValueError) as err:
            raise UserError(f"the model config in {resume.path} is damaged ({err}); resume from another "
                            "checkpoint") from None
        return GPT(arch)
    return GPT.from_pretrained(weights, block_size=cfg.block_size, dropout=cfg.dropout)
