"""Run train.py with an injected fault, for the resume and NaN tests.

    [accelerate launch ...] tests/fault_train.py [train.py flags]

FAULT (environment) picks the fault; without it this is plain train.py:
- `kill_after_step:N`  SIGKILL every process once N optimizer steps are done (between checkpoints)
- `kill_in_save:N`     SIGKILL every process while the checkpoint of step N is written, before it is published
- `kill_in_save_state:N`  SIGKILL inside accelerate's save_state of step N: the model file is written, the
                       optimizer state not yet
- `kill_in_rotation:N` SIGKILL while the save of step N deletes older checkpoints (gpt_config.json of the oldest gone)
- `kill_in_export`     SIGKILL while final/ is written (its files in the temp folder, not yet renamed into place)
- `nan_at_step:N`      the loss of optimizer step N (1-based) is NaN
- `ctrl_c_in_step:N`   Ctrl-C as a terminal gives it (SIGINT to the launcher under `accelerate launch`, else to this
                       process) as optimizer step N (1-based) begins, from rank 0
- `ctrl_c_twice_in_step:N`  the same, twice in a row
- `sigterm_in_step:N`  SIGTERM to this process (a scheduler's preemption) as optimizer step N (1-based) begins
- `slow_rank_0:S`      rank 0 starts S seconds after the others (a busy machine, a slow node's imports)
- `kill_rank_1_after_step:N`  SIGKILL rank 1 alone once N steps are done, in the launch's first attempt
- `kill_rank_1_every_attempt:N`  the same in every attempt of the launch (restarts never get past it)
- `kill_rank_1_in_save:N`  SIGKILL rank 1 alone while it writes its files of the checkpoint of step N
- `kill_rank_1_in_eval`  SIGKILL rank 1 alone inside its first validation evaluation
- `stop_rank_1_after_step:N`  SIGSTOP rank 1 alone once N steps are done (a hung process), first attempt
- `error_on_rank_1_at_step:N`  a UserError on rank 1 alone as step N+1 begins, in every attempt (a deterministic
                       error)
- `crash_on_rank_1_at_step:N`  the same with a RuntimeError (a bug: a traceback, not a UserError's line)

NO_RETRY_WAIT (environment): no sleeping between the retries of huggingface_hub, datasets and data.streaming (the
number of attempts is unchanged), for the tests that exhaust them.

ENGINE_SHIM=1 (environment): a DeepSpeed or FSDP accelerate config runs on this CPU machine, on gloo
(tests/engine_shim.py); ENGINE_PROBE (a folder) then receives each rank's parameter and optimizer-state sizes.
PIPELINE_PROBE (a folder): each rank of a --pipeline_parallel run writes the parameters it holds there.
"""
import gc
import importlib.util
import os
import shutil
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# What this file imports before train.py runs (the engine shim's and the faults' torch and accelerate) is imported with
# the collector off, as train.py imports its own (common/imports.py), which then freezes both.
gc.disable()

if os.environ.get("ENGINE_SHIM") == "1":  # a DeepSpeed or FSDP launch on this CPU machine (tests/engine_shim.py)
    sys.path.insert(0, str(ROOT / "tests"))
    import engine_shim

    engine_shim.install()
    if os.environ.get("ENGINE_PROBE"):  # a folder: what each rank holds, written at each checkpoint
        engine_shim.probe_shards(os.environ["ENGINE_PROBE"])

if os.environ.get("PIPELINE_PROBE"):  # a folder: the parameters each pipeline rank holds, written at each checkpoint
    import json

    from training.distributed.pipeline import PipelinedGPT

    gather_whole = PipelinedGPT.gather_whole

    def gather_whole_probed(self):
        held = {name: p.numel() for name, p in self.named_parameters()}
        Path(os.environ["PIPELINE_PROBE"], f"rank{os.environ.get('RANK', '0')}.json").write_text(
            json.dumps({"stage": self.pipeline.stage, "replica": self.pipeline.replica, "params": held}))
        return gather_whole(self)

    PipelinedGPT.gather_whole = gather_whole_probed

spec = importlib.util.spec_from_file_location("train", ROOT / "train.py")
train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train)

kind, _, at = os.environ.get("FAULT", "").partition(":")
at = int(at or 0)

# Faults of rank 1 alone, in its launch's first attempt (torch's elastic agent's TORCHELASTIC_RESTART_COUNT 0), or in
# every attempt for `kill_rank_1_every_attempt`. A restarted rank 1 starts 3 s late (a slow node), so that the other
# rank always reaches the rendezvous first (it read the dead rank's address, left in the store, before issue 35).
rank_1 = os.environ.get("RANK") == "1"
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
if kind.startswith(("kill_rank_1", "stop_rank_1", "error_on_rank_1", "crash_on_rank_1")) and rank_1 and \
        not first_attempt:
    import time

    time.sleep(3)
faulty = rank_1 and (first_attempt or kind in ("kill_rank_1_every_attempt", "error_on_rank_1_at_step",
                                               "crash_on_rank_1_at_step"))
if kind in ("kill_rank_1_after_step", "kill_rank_1_every_attempt", "stop_rank_1_after_step",
            "error_on_rank_1_at_step", "crash_on_rank_1_at_step"):
    from common.errors import UserError
    from training.step import LRSchedule

    factor = LRSchedule.factor

    def factor_then_rank_1_fails(self, step):  # called at the start of step `step` (0-based)
        if step == at and faulty:
            if kind == "error_on_rank_1_at_step":
                raise UserError(f"an error of rank 1 alone at step {step + 1}")
            if kind == "crash_on_rank_1_at_step":
                raise RuntimeError(f"a crash of rank 1 alone at step {step + 1}")
            os.kill(os.getpid(), signal.SIGSTOP if kind == "stop_rank_1_after_step" else signal.SIGKILL)
        return factor(self, step)

    LRSchedule.factor = factor_then_rank_1_fails
elif kind == "kill_rank_1_in_save":  # while writing the checkpoint of step N, before it is published
    import accelerate.checkpointing as checkpointing

    save = checkpointing.save

    def save_then_rank_1_dies(obj, f, *args, **kwargs):
        if faulty and Path(f).parent.name == f".tmp-step_{at:06d}":
            os.kill(os.getpid(), signal.SIGKILL)
        return save(obj, f, *args, **kwargs)

    checkpointing.save = save_then_rank_1_dies
elif kind == "kill_rank_1_in_eval":  # inside the first validation evaluation (its text sample, after the loss)
    import training.evaluations.validation as validation

    sample = validation.sample

    def sample_then_rank_1_dies(*args, **kwargs):
        if faulty:
            os.kill(os.getpid(), signal.SIGKILL)
        return sample(*args, **kwargs)

    validation.sample = sample_then_rank_1_dies
elif kind == "kill_after_step":
    from training.step import LRSchedule

    factor = LRSchedule.factor

    def factor_then_die(self, step):  # called at the start of step `step` (0-based)
        if step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return factor(self, step)

    LRSchedule.factor = factor_then_die
elif kind in ("ctrl_c_in_step", "ctrl_c_twice_in_step", "sigterm_in_step"):
    from training.step import LRSchedule

    factor = LRSchedule.factor
    # Under accelerate launch the terminal's Ctrl-C reaches the launcher (this process's parent), which forwards it.
    target = os.getppid() if "LOCAL_RANK" in os.environ and kind != "sigterm_in_step" else os.getpid()
    sent = signal.SIGTERM if kind == "sigterm_in_step" else signal.SIGINT

    def factor_then_ctrl_c(self, step):  # called as step `step + 1` begins
        if step + 1 == at and os.environ.get("RANK", "0") == "0":
            for _ in range(2 if kind == "ctrl_c_twice_in_step" else 1):
                os.kill(target, sent)
        return factor(self, step)

    LRSchedule.factor = factor_then_ctrl_c
elif kind == "kill_in_save":
    import training.checkpoints.checkpoint as checkpoint

    rename_into_place = checkpoint.rename_into_place

    def die_before_publish(tmp, final):  # runs after save_state, before the rename that publishes
        if tmp.name == f".tmp-step_{at:06d}":
            os.kill(os.getpid(), signal.SIGKILL)
        rename_into_place(tmp, final)

    checkpoint.rename_into_place = die_before_publish
elif kind == "kill_in_save_state":
    import accelerate.checkpointing as checkpointing

    save = checkpointing.save

    def save_then_die_before_the_optimizer(obj, f, *args, **kwargs):
        if Path(f).name == "optimizer.bin" and Path(f).parent.name == f".tmp-step_{at:06d}":
            os.kill(os.getpid(), signal.SIGKILL)
        return save(obj, f, *args, **kwargs)

    checkpointing.save = save_then_die_before_the_optimizer
elif kind == "kill_in_rotation":
    import training.checkpoints.checkpoint as checkpoint

    class ShutilDyingInRotation:
        """training.checkpoints.checkpoint's shutil, whose rmtree of an old checkpoint dies after one file."""

        def __getattr__(self, name):
            return getattr(shutil, name)

        @staticmethod
        def rmtree(path, *args, **kwargs):
            path = Path(path)
            if path.name.startswith("step_") and (path.parent / f"step_{at:06d}").is_dir():
                (path / "gpt_config.json").unlink()  # the file that makes a step folder a complete checkpoint
                os.kill(os.getpid(), signal.SIGKILL)
            return shutil.rmtree(path, *args, **kwargs)

    checkpoint.shutil = ShutilDyingInRotation()
elif kind == "kill_in_export":
    import training.checkpoints.export as export

    rename_into_place = export.rename_into_place

    def die_before_final_is_published(tmp, final):
        os.kill(os.getpid(), signal.SIGKILL)

    export.rename_into_place = die_before_final_is_published
elif kind == "slow_rank_0":
    if os.environ.get("RANK", "0") == "0":
        import time

        time.sleep(at)
elif kind == "nan_at_step":
    from model import GPT

    forward = GPT.forward
    calls = {"n": 0}

    def forward_with_nan(self, idx, targets=None, **kwargs):
        logits, loss = forward(self, idx, targets, **kwargs)
        if targets is not None and self.training:
            calls["n"] += 1
            step = (calls["n"] - 1) // int(os.environ["GRAD_ACCUM"]) + 1
            if step == at:
                loss = loss * float("nan")
        return logits, loss

    GPT.forward = forward_with_nan

if os.environ.get("NO_RETRY_WAIT"):
    import time
    import types

    import datasets
    import huggingface_hub.utils._http as hub_http

    import data.streaming as streaming

    hub_http.time = types.SimpleNamespace(sleep=lambda seconds: None, time=time.time)
    datasets.config.STREAMING_READ_RETRY_INTERVAL = datasets.config.STREAMING_READ_SERVER_UNAVAILABLE_RETRY_INTERVAL = 0
    streaming.RETRY_WAIT = 0.0

gc.enable()

train.run_cli(train.main)
