"""Our FSDP-specific code on a model sharded by torch's FSDP2 itself (`fully_shard` on gloo, no accelerate), with
activation checkpointing inside the sharded blocks: train_step's global gradient norm as a DTensor
(`.full_tensor()`), accumulation with sharded gradients, validation loss and HellaSwag running forwards on every
rank of the sharded model, and the full state dict gathered from shards, against one process.

The same without activation checkpointing is train.py's own FSDP2 run through accelerate's plugin
(test_engines: the step, the validation loss, the gathered export) and its 2-D run with HellaSwag
(test_tensor_parallel); this file keeps the case those do not run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT, free_port

SCRIPT = REPO_ROOT / "tests" / "fixtures" / "fsdp" / "fsdp2_steps.py"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp2_sharded_step_with_activation_checkpointing_and_evaluations_equal_one_process(tmp_path):
    """`GPT.activation_checkpointing` on the sharded model: the one-process step, evaluations and weights.

    torch's `fully_shard` on gloo: a step on the sharded model (sharded gradients, accumulation, each block gathered
    again to recompute), validation loss and HellaSwag forwards on every rank, and the full state dict gathered from the
    shards equal one unsharded process. Without activation checkpointing, train.py's FSDP2 run through accelerate's
    plugin is test_engines.py's, its 2-D run with HellaSwag test_tensor_parallel.py's.

    Seen to catch: the validation loss with each rank running only its own number of batches: the ranks' collectives no
    longer line up, the run hangs and the test fails at its timeout. The local shard of the grad-norm DTensor used
    instead of `full_tensor()` is not caught: FSDP2's total norm is replicated, so both are equal. The recomputation
    part was not broken on purpose."""
    recompute = ["activation_checkpointing"]
    sys.path.insert(0, str(SCRIPT.parent))
    import fsdp2_steps as ref_script  # the same config and data, run here on one process without sharding

    from eval.hellaswag import evaluate_hellaswag, load_items
    from eval.val_loss import evaluate_loss
    from model import GPT

    out = tmp_path / "fsdp.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(SCRIPT), str(out), *recompute], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = json.loads(out.read_text())
    gathered = torch.load(out.with_suffix(".pt"), weights_only=True)

    torch.manual_seed(0)
    model = GPT(ref_script.CONFIG)
    g = torch.Generator().manual_seed(1)
    batches = [(x[:, :-1], x[:, 1:]) for x in torch.randint(0, 50257, (4, 2, 33), generator=g)]
    loss = sum(model(x, y)[1] for x, y in batches) / len(batches)  # the mean over the global batch
    loss.backward()
    grad_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    tokens = torch.randint(0, 50257, (1 + 32 * 5,), generator=g)

    assert sharded["world"] == 2
    assert sharded["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    # One SGD step (lr 0.1) from the same weights: the weights differ by 0.1 x the gradient's rounding, a few fp32
    # spacings; no AdamW step turns a near-zero gradient's rounding into a whole update here (tests/bounds.py).
    for name, value in model.state_dict().items():
        torch.testing.assert_close(gathered[name], value, atol=1e-6, rtol=1e-5, msg=name)
    assert sharded["val_loss"] == pytest.approx(evaluate_loss(model, tokens, block_size=32, batch_size=2), rel=1e-5)
    single = evaluate_hellaswag(model, load_items(ref_script.HELLASWAG), batch_size=2)
    assert sharded["hellaswag"] == pytest.approx(single)
