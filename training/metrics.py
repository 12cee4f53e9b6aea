"""Where a run's numbers go: `metrics.jsonl` in the run folder, accelerate's trackers, the run's header and one
console line per logged step (`StepLine`).

`metrics.jsonl` holds one JSON object per logged step: `step`, `loss`, `lr`, `grad_norm`, `tokens`, `tok_per_sec`,
`mfu`, `data_wait_s`. On the steps they happen it adds `val_loss` / `hellaswag_*` with `eval_s`, and `checkpoint_s`;
such a step without a log line gets a line with those alone. Scripts outside the repo read these keys. After a
resume, lines past the checkpoint's step are dropped, so the file reads as one run. Only the main process writes.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import re
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from accelerate import Accelerator

from common.errors import UserError
from common.parallelism import Parallelism
from common.run_dir import RunDir
from configs import LogConfig
from model.loss import describe_loss_path, loss_chunk_rows_on
from model.unwrap import unwrapped
from training.distributed.engines import precision
from training.distributed.pipeline import stage_line
from training.distributed.prepare import step_placement
from training.distributed.processes import BatchGeometry
from training.mfu import estimate_mfu, peak_flops
from training.optimizers.plan import OptimizerPlan, describe_optimizers
from training.timing import DATA, SHOW_DATA_ABOVE, RunClock

# `--report_to` value -> accelerate's trackers. "all" is those of the core install; trackio is an extra.
TRACKERS = {"none": [], "tensorboard": ["tensorboard"], "wandb": ["wandb"], "trackio": ["trackio"],
            "all": ["tensorboard", "wandb"]}
# The trackers that an extra of pyproject.toml installs, and its name.
EXTRA_OF = {"trackio": "trackio"}


def trackers_for(report_to: str) -> list[str] | None:
    """`--report_to` value -> accelerate's `log_with` list. A tracker that is not installed is one line naming the
    install; accelerate would warn and run on without it."""
    for name in TRACKERS[report_to]:
        if name in EXTRA_OF and find_spec(name) is None:
            raise UserError(f"--report_to {report_to} needs {name}, which is not installed; pip install -e "
                            f"\".[{EXTRA_OF[name]}]\" (or pip install {name}), or choose another --report_to")
    return TRACKERS[report_to] or None


# A terminal's colour and style codes (ESC [ ... m), as trackio prints its banner's command whatever stdout is.
_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*m")


@contextmanager
def trackers_in_plain_text() -> Iterator[None]:
    """What the trackers print while they start or finish, without terminal codes where stdout is not a terminal (a
    log, a pipe): trackio's banner colours its `trackio show --project ...` line (ESC[1m ESC[38;5;208m ... ESC[0m),
    noise in a run's log. On a terminal their output passes as it is."""
    if sys.stdout is None or sys.stdout.isatty():
        yield
        return
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        sys.stdout.write(_TERMINAL_CODES.sub("", printed.getvalue()))
        sys.stdout.flush()


def tracker_run_name(run_name: str | None, run: RunDir, run_id: str) -> str:
    """The trackio run's name: `--run_name` (default: the folder's name) and the run's id. The id is kept in the
    checkpoints, so a resume continues the trackio run and another run of the same name starts its own."""
    return f"{run_name or run.path.name}-{run_id}"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The logged steps of a `metrics.jsonl`, oldest first; a torn line (a killed run) is skipped."""
    rows: list[dict[str, Any]] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
    return rows


class MetricsLog:
    """Append-only JSON-lines log of a run, mirrored to the trackers."""

    def __init__(self, accelerator: Accelerator, out_dir: str | Path, resume_step: int | None) -> None:
        self.accelerator = accelerator
        self.path = RunDir(out_dir).metrics_file
        if accelerator.is_main_process:
            self._truncate_after(resume_step or 0)

    def _truncate_after(self, step: int) -> None:
        """Drop lines logged after `step` (by the attempt that crashed after its last checkpoint)."""
        if self.path.is_file():
            kept = [row for row in read_metrics(self.path) if isinstance(row["step"], int) and row["step"] <= step]
            self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Record `values` for `step`, if any. NaN and inf become null, since JSON has no NaN."""
        if not self.accelerator.is_main_process or not values:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        numeric = {k: v for k, v in clean.items() if isinstance(v, (int, float))}
        self.accelerator.log(numeric, step=step)


class Throughput:
    """Training tokens per second over the steps since the last reading (evaluations and saves excluded)."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.seconds, self.steps = 0.0, 0

    @contextmanager
    def timing(self, wait_for: torch.device | None = None) -> Iterator[None]:
        """Time one optimizer step; `wait_for`: a device whose queued work the step waits for at its end."""
        start = time.perf_counter()
        yield
        if wait_for is not None and wait_for.type == "cuda":
            torch.cuda.synchronize(wait_for)
        self.seconds += time.perf_counter() - start
        self.steps += 1

    def read(self) -> float:
        """Tokens per second (all processes together) since the last `read`, then start over."""
        rate = self.tokens_per_step * self.steps / self.seconds if self.seconds else 0.0
        self.seconds, self.steps = 0.0, 0
        return rate


class StepLine:
    """The console line of a logged step, made to be read in a log file and grepped:

        step 30/150 | loss 6.412 | lr 9.6e-04 | grad 0.81 | 1,120 tok/s | mfu - | 0:00:31 elapsed, 0:02:04 left

    Elapsed is wall time since this process started training, evaluations and saves included, so the ETA includes
    them too. `mfu -` where the peak is unknown."""

    def __init__(self, max_steps: int, start_step: int) -> None:
        self.max_steps, self.start_step = max_steps, start_step
        self.start = time.monotonic()

    def format(self, step: int, record: dict[str, Any], data_share: float = 0.0) -> str:
        """`data_share` is the logged steps' share of time waiting for data, shown above `SHOW_DATA_ABOVE`."""
        elapsed = time.monotonic() - self.start
        done = step - self.start_step
        left = elapsed / done * (self.max_steps - step) if done else 0.0
        mfu = record["mfu"]
        data = f" | data {data_share:.0%}" if data_share > SHOW_DATA_ABOVE else ""
        return (f"step {step}/{self.max_steps} | loss {record['loss']:.3f} | lr {record['lr']:.1e} | "
                f"grad {record['grad_norm']:.2f} | {record['tok_per_sec']:,.0f} tok/s | "
                f"mfu {'-' if mfu is None else f'{mfu:.1%}'}{data} | {_clock(elapsed)} elapsed, {_clock(left)} left")


class StepReport:
    """What a logged step reports, as a console line and a `metrics.jsonl` record: loss averaged over ranks, LR,
    gradient norm, tokens, tokens/s, MFU and the slowest rank's data wait. Steps are timed with `timing()`;
    `of_step` reads them every `log_every` steps and at the last."""

    def __init__(self, cfg: LogConfig, accelerator: Accelerator, max_steps: int, start_step: int,
                 tokens_per_step: int, flops_per_token: float, clock: RunClock) -> None:
        self.accelerator, self.log_every, self.flops_per_token = accelerator, cfg.log_every, flops_per_token
        self.clock = clock
        self.peak = peak_flops(accelerator.device, cfg.mfu_peak_flops)  # None where unknown: no MFU then
        self.throughput, self.line = Throughput(tokens_per_step), StepLine(max_steps, start_step)

    def logs(self, step: int, last: bool) -> bool:
        """Whether optimizer step `step` (1-based) is a logged one."""
        return last or step % self.log_every == 0

    def timing(self, step: int, last: bool):
        """Time the optimizer step that will be `step`. Only a logged step waits for the device at its end, so the
        time read there holds every step's device work."""
        return self.throughput.timing(self.accelerator.device if self.logs(step, last) else None)

    def of_step(self, step: int, last: bool, mean_loss: torch.Tensor, lr: float, grad_norm: torch.Tensor,
                tokens: int, write: Callable[[str], None]) -> dict[str, Any]:
        """The record of step `step` if it is logged (printed with `write`), else {}. `mean_loss` (this rank's) and
        `grad_norm` are read from the device here; the loss is averaged over the ranks."""
        if not self.logs(step, last):
            return {}
        loss = self.accelerator.reduce(mean_loss, reduction="mean").item()
        grad_norm = float(grad_norm)
        waited = torch.tensor([self.clock.since_last(DATA)], device=self.accelerator.device)
        data_wait = self.accelerator.reduce(waited, reduction="max").item()  # the step waits for the slowest rank
        steps_seconds = self.throughput.seconds
        tok_per_sec = self.throughput.read()
        mfu = estimate_mfu(self.flops_per_token, tok_per_sec, self.accelerator.num_processes, self.peak)
        record = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens, "tok_per_sec": tok_per_sec,
                  "mfu": mfu, "data_wait_s": round(data_wait, 4)}
        if self.accelerator.is_main_process:
            write(self.line.format(step, record, data_wait / steps_seconds if steps_seconds else 0.0))
        return record


def _clock(seconds: float) -> str:
    """H:MM:SS, whole seconds."""
    return str(timedelta(seconds=round(seconds)))


def run_header(accelerator: Accelerator, parallelism: Parallelism, model: torch.nn.Module, n_params: int,
               geometry: BatchGeometry, plan: OptimizerPlan, grad_clip: float, lora: str | None, data: str,
               restart: str | None = None, here: str | None = None) -> str:
    """The run's header. Its first line: model size (`n_params`, tied weights once; what LoRA trains), batch
    geometry, engine, precision, compilation, activation checkpointing, the loss's path, device and `restart`. Then
    `here` (what a launch runs on this machine, where it differs from the config), the optimizers' line (with
    "gradient clipping off" at `--grad_clip 0`) and `data`, the data source's line. `model` is the prepared model;
    under model parallelism the geometry's world counts data-parallel ranks."""
    # accelerate wraps the prepared model in torch.compile's OptimizedModule when a dynamo backend is set.
    compiled = f"torch.compile ({accelerator.state.dynamo_plugin.backend.value.lower()})" \
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else "eager"
    network = unwrapped(model)
    if getattr(network, "activation_checkpointing", False):  # a LoRA model is our GPT with peft's layers inside
        compiled += " | activation checkpointing"
    holder = getattr(network, "stage", network)  # a pipeline's stage holds its loss's setting
    rows = getattr(holder, "loss_chunk_rows", None)
    compiled += " | " + describe_loss_path(loss_chunk_rows_on(accelerator.device.type, rows), accelerator.device.type)
    adapters = ""
    if lora:
        params = list(model.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        adapters = f" ({lora}: {trainable:,} trainable, {trainable / sum(p.numel() for p in params):.2%} of all)"
    distributed = parallelism.header_words(accelerator.distributed_type.value, stage_line(model))
    g = geometry
    ranks = "data-parallel rank(s)" if parallelism.model_parallel > 1 else "process(es)"
    optimizers = describe_optimizers(network, plan, step_placement(accelerator, model),  # Muon: how it splits
                                     stage=stage_line(model))  # a pipeline's: this stage's parameters
    if not grad_clip:
        optimizers += "; gradient clipping off (--grad_clip 0)"
    return (f"GPT {n_params / 1e6:.2f}M params{adapters} | {g.world_size} {ranks} x {g.accumulation} "
            f"accumulation x {g.micro_batch_size} x {g.block_size} = {g.tokens_per_step:,} tokens per step | "
            f"distributed: {distributed} | precision: {precision(accelerator)} | "
            f"{compiled} | {accelerator.device}{f' | {restart}' if restart else ''}\n"
            + (f"{here}\n" if here else "") + f"{optimizers}\n{data}")
