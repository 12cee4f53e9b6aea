"""The network a run trains: new from the flags, pretrained (`--init_from`), or a fine-tune being resumed.

The architecture that runs is the built model's `config` (a `GPTConfig`); with `--init_from` it comes from
the weights, not from the architecture flags, which are then unused. It is computed here once; the run
records it (`training.run_folder.recorded_config`), the parsed flags are never changed.
"""
from __future__ import annotations

import sys

from common.errors import UserError, launch_rank
from common.weights import Weights, resolve_weights
from configs import ModelConfig
from model import GPT, GPTConfig
from model.lora import add_adapters, check_resume, run_lora_config
from training.checkpoints.resume import ResumePoint


def build_model(cfg: ModelConfig, resume: ResumePoint | None, activation_checkpointing: bool = False,
                loss_chunk_rows: int | None = None) -> tuple[GPT, Weights | None]:
    """The network: from the flags (`init_from scratch`), from `init_from` weights, or, for a fine-tune being
    resumed, the checkpoint's architecture (its weights replace init_from's when loaded). With `--lora_rank`,
    the network gets adapters and only they train (see `model.lora`). With `activation_checkpointing`, each
    block's activations are recomputed in the backward pass (`GPT.activation_checkpointing`; the weights, the
    checkpoints and the exports are the same either way). `loss_chunk_rows`: the training loss's path
    (`GPT.loss_chunk_rows`; None: the default of the device the forward runs on, resolved there, since the model is
    built on the CPU and moved after). Also what `--init_from` resolved to (None from scratch;
    not downloaded for a full fine-tune being resumed, whose checkpoint holds every weight)."""
    download = resume is None or bool(cfg.lora_rank)
    weights = None if cfg.from_scratch else resolve_weights(cfg.init_from, download=download)
    lora = run_lora_config(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_list, weights) \
        if cfg.lora_rank else None  # the adapters' settings, on the weights --init_from resolved to
    if resume is not None:
        check_resume(lora, resume.path)  # a LoRA checkpoint only into the same LoRA run, a full one into a full
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
    """The architecture flags set (away from their defaults) to values the weights do not have: with --init_from
    the weights decide, and a user who asked for another shape should hear that it was not built."""
    if cfg.from_scratch:
        return []
    defaults = ModelConfig()
    return [f"--{name} {getattr(cfg, name)}" for name in ("n_layer", "n_head", "n_embd", "bias")
            if getattr(cfg, name) not in (getattr(arch, name), getattr(defaults, name))]


def scratch_architecture(cfg: ModelConfig) -> GPTConfig:
    """The architecture the flags describe, for a run from scratch (and the memory plan of one)."""
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
