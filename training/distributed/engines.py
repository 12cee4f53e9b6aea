"""The engine a launch trains with, chosen by its accelerate config, and what each needs from the run. DDP (full
replicas, also one process), accelerate's FSDP2 plugin, or DeepSpeed ZeRO-1/2/3.

accelerate falls back silently: a DeepSpeed or FSDP config where it finds no device (or with `use_cpu`) trains plain
DDP, or one lone process per rank, and exits 0. The run refuses that in one line (`check_engine`,
`check_world_size`), so the engine that runs is the one the config asked for.

Under DeepSpeed the run keeps its own optimizer and its own learning rate per step, as under DDP. DeepSpeed's config
gets the batch geometry and clipping from the run's flags (`fit_deepspeed`), so one set of flags means one run under
every engine. DeepSpeed steps inside `accelerator.backward` of a step's last micro-batch, clipped by its
`gradient_clipping`; `clip_grad_norm_` then returns the norm it measured.
"""
from __future__ import annotations

import json
import os
from importlib.util import find_spec
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from common.engine_names import DDP, DEEPSPEED, FAMILY_NAMES, FSDP
from common.errors import UserError
from common.parallelism import Parallelism
from model.unwrap import unwrapped
from training.distributed.support import conditions, refusal


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def running_engine(accelerator: Accelerator) -> Parallelism:
    """The engine this process's Accelerator runs (its degrees are the launch's flags, not accelerate's)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return Parallelism(DEEPSPEED, int(accelerator.state.deepspeed_plugin.zero_stage))
    return Parallelism(FSDP if accelerator.distributed_type == DistributedType.FSDP else DDP)


def precision(accelerator: Accelerator) -> str:
    """The run's precision as the header names it. Under DeepSpeed accelerate reports "no", so it is read from
    DeepSpeed's config: "bf16" or "fp16" weights with an fp32 master copy."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return accelerator.mixed_precision
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    enabled = [dtype for dtype in ("bf16", "fp16") if str(config.get(dtype, {}).get("enabled")).lower() == "true"]
    return enabled[0] if enabled else "no"


def requested_engine() -> str:
    """The engine the accelerate config asked for, as `accelerate launch` tells its processes: "deepspeed", "fsdp",
    else "ddp"."""
    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        return DEEPSPEED
    if _env_flag("ACCELERATE_USE_FSDP"):
        return FSDP
    return DDP


def launch_engine() -> Parallelism:
    """The engine the launch's accelerate config asks for, without degrees, read before any Accelerator exists (for
    `--plan`). For DeepSpeed the ZeRO stage comes from the config or its `deepspeed_config_file`."""
    kind = requested_engine()
    if kind != DEEPSPEED:
        return Parallelism(kind)
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if stage is None and config_file:
        try:
            stage = json.loads(Path(config_file).read_text()).get("zero_optimization", {}).get("stage")
        except (OSError, ValueError) as err:
            raise UserError(f"cannot read the DeepSpeed config {config_file} ({err}); fix the path in the "
                            "accelerate config") from None
    return Parallelism(DEEPSPEED, int(stage or 0))


CPU_FIX = ("DeepSpeed and FSDP run on GPUs; on a CPU, launch with accelerate_configs/cpu_2proc.yaml (DDP on gloo), "
        "which trains the same run unsharded (without --tensor_parallel, which needs FSDP on GPUs: no launch on a CPU "
        "runs it)")


def refuse_engine_on_cpu() -> None:
    """Refuse a DeepSpeed or FSDP config that also asks for the CPU. accelerate would train plain DDP (FSDP) or stop
    with its own AttributeError (DeepSpeed)."""
    asked = requested_engine()
    if asked != DDP and os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes"):
        name = FAMILY_NAMES[asked]
        raise UserError(f"the accelerate config asks for {name} and for the CPU (use_cpu / ACCELERATE_USE_CPU), "
                        f"which accelerate runs as plain DDP, not {name}; {CPU_FIX}")


def check_world_size(launched: int, joined: int) -> None:
    """Refuse a launch whose ranks each came up alone: accelerate found no backend for the config's engine, and every
    rank would train the whole batch by itself."""
    if launched > 1 and joined != launched:
        engine = FAMILY_NAMES[requested_engine()] if requested_engine() != DDP else "its engine"
        raise UserError(f"this launch started {launched} processes but accelerate brought up {joined} as a group "
                        f"(it found no device for {engine} on this machine); {CPU_FIX}")


def check_engine(accelerator: Accelerator) -> None:
    """Refuse a launch whose engine is not the one the config asked for. Known fallbacks are refused earlier, with
    their causes (`refuse_engine_on_cpu`, `check_world_size`); this is the backstop."""
    asked = requested_engine()
    if asked != DDP and running_engine(accelerator).kind != asked:
        raise UserError(f"the accelerate config asks for {FAMILY_NAMES[asked]}, but "
                        f"accelerate runs this launch as {accelerator.distributed_type.value} on "
                        f"{accelerator.device.type}; {CPU_FIX}")


def deepspeed_missing() -> str | None:
    """The line to print when the launch asks for DeepSpeed and it is not installed; None otherwise. Checked before
    accelerate imports it, whose own message is a traceback."""
    if requested_engine() == DEEPSPEED and find_spec("deepspeed") is None:
        return ("the accelerate config asks for DeepSpeed, which is not installed; pip install -e \".[deepspeed]\" "
                "(or use a DDP or FSDP config)")
    return None


def refuse_unsupported(parallelism: Parallelism, accelerator: Accelerator, optimizer: str, lora: bool, on_nan: str,
                       activation_checkpointing: bool, grad_clip: float = 1.0) -> None:
    """Refuse in one line, before anything is built, what does not run under `parallelism`: the support table's
    features (Muon under ZeRO depends on `grad_clip`), then what the config's contents rule out."""
    settings = conditions(grad_clip)
    for feature, asked in ((f"--optimizer {optimizer}", True), ("--lora_rank", lora),
                           ("--on_nan skip", on_nan == "skip")):
        if asked and (line := refusal(feature, parallelism, settings=settings)):
            raise UserError(line)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if activation_checkpointing and parallelism.kind == FSDP and plugin is not None and \
            plugin.activation_checkpointing:
        # accelerate's fsdp2_apply_ac wraps blocks GPT.forward already checkpoints. Each would be recomputed twice,
        # the outer time without the forward's RNG state, so with other dropout masks.
        raise UserError("--activation_checkpointing and the accelerate config's fsdp_activation_checkpointing would "
                        "each recompute every block (twice in all); keep --activation_checkpointing and set "
                        "fsdp_activation_checkpointing: false in the accelerate config")
    if parallelism.kind != DEEPSPEED:
        return
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    for block, ours in (("an \"optimizer\"", "--optimizer/--lr/--weight_decay"), ("a \"scheduler\"", "--warmup_steps")):
        if block.split('"')[1] in config:
            raise UserError(f"the DeepSpeed config has {block} block; train.py trains with its own ({ours}), so one "
                            "set of flags means one run under every engine: remove the block")
    if "activation_checkpointing" in config:
        raise UserError("the DeepSpeed config has an \"activation_checkpointing\" block, which acts only on models "
                        "that call deepspeed.checkpointing; remove it and pass --activation_checkpointing")


def fit_deepspeed(accelerator: Accelerator, micro_batch_size: int, accumulation: int, grad_clip: float,
                  n_embd: int, muon: bool = False) -> None:
    """Write the run's batch geometry and clipping into the DeepSpeed config before `accelerator.prepare`. train.py
    passes no DataLoader for accelerate to read them from. The config's own values, where set, must agree.

    Under ZeRO-3 the bucket sizes follow the width (accelerate reads them from a Hugging Face config, which our GPT
    lacks), and the full weights are gathered for `final/`. With DeepSpeed's Muon (`muon`), ZeRO-3 reduces without
    reduce-scatter, which that Muon refuses. A no-op under other engines."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    plugin = accelerator.state.deepspeed_plugin
    config = plugin.deepspeed_config
    ours = {"train_micro_batch_size_per_gpu": (micro_batch_size, "--micro_batch_size"),
            "gradient_accumulation_steps": (accumulation, "--total_batch_size (the accumulation it implies)"),
            "train_batch_size": (micro_batch_size * accumulation * accelerator.num_processes, "--total_batch_size"),
            "gradient_clipping": (grad_clip, "--grad_clip")}  # 0: DeepSpeed's "no clipping", as ours
    for key, (value, flag) in ours.items():
        given = config.get(key, "auto")
        if given not in ("auto", None) and given != value:
            raise UserError(f"the DeepSpeed config sets {key} {given}, this run's {flag} makes it {value}; set it to "
                            "\"auto\" (or remove it) in the DeepSpeed config: train.py fills it from its flags")
        config[key] = value
    zero = config.setdefault("zero_optimization", {})
    if plugin.zero_stage == 3:
        for key, value in (("reduce_bucket_size", n_embd * n_embd),
                           ("stage3_prefetch_bucket_size", int(0.9 * n_embd * n_embd)),
                           ("stage3_param_persistence_threshold", 10 * n_embd)):
            if zero.get(key, "auto") == "auto":
                zero[key] = value
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        if muon:
            if zero.get("reduce_scatter") is True:
                raise UserError("the DeepSpeed config sets zero_optimization.reduce_scatter true, which ZeRO-3 does "
                                "not run beside DeepSpeed's Muon (--optimizer muon); remove it from the config")
            zero["reduce_scatter"] = False


def full_state_dict(accelerator: Accelerator, model) -> dict | None:
    """The trained weights, whole, on the main process; None elsewhere. Call on every rank: FSDP and ZeRO gather.

    Under DeepSpeed these are the fp32 master weights, gathered tensor by tensor, as a DDP run exports them. Under
    bf16 the module holds bf16 copies, which `accelerator.get_state_dict` would export."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return accelerator.get_state_dict(model)
    if accelerator.distributed_type != DistributedType.DEEPSPEED:  # accelerate's get_state_dict imports DeepSpeed
        return unwrapped(model).state_dict()
    from deepspeed.utils import safe_get_full_fp32_param

    full = {}
    for name, tensor in accelerator.unwrap_model(model).state_dict(keep_vars=True).items():  # same order on every rank
        master = safe_get_full_fp32_param(tensor) if isinstance(tensor, torch.nn.Parameter) else None
        value = (master if master is not None else tensor).detach()
        if accelerator.is_main_process:
            full[name] = value.cpu().clone()
    return full if accelerator.is_main_process else None
