"""Run train.py with an injected fault, for the resume and NaN tests.

    [accelerate launch ...] tests/fault_train.py [train.py flags]

FAULT (environment) picks the fault; without it this is plain train.py:
- `kill_after_step:N`  SIGKILL every process once N optimizer steps are done (between checkpoints)
- `kill_in_save:N`     SIGKILL every process while the checkpoint of step N is written, before it is published
- `nan_at_step:N`      the loss of optimizer step N (1-based) is NaN
"""
import importlib.util
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

spec = importlib.util.spec_from_file_location("train", ROOT / "train.py")
train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train)

kind, _, at = os.environ.get("FAULT", "").partition(":")
at = int(at or 0)

if kind == "kill_after_step":
    learning_rate = train.learning_rate

    def learning_rate_then_die(cfg, step):  # called at the start of step `step` (0-based)
        if step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return learning_rate(cfg, step)

    train.learning_rate = learning_rate_then_die
elif kind == "kill_in_save":
    import training.checkpoint as checkpoint

    publish = checkpoint.publish

    def die_before_publish(tmp, final):  # runs after save_state, before the rename that publishes
        if tmp.name == f".tmp-step_{at:06d}":
            os.kill(os.getpid(), signal.SIGKILL)
        publish(tmp, final)

    checkpoint.publish = die_before_publish
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

train.run_cli(train.main)
