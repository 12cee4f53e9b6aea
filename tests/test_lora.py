"""LoRA through peft (`--lora_rank`): only the adapters train and are checkpointed, a killed run resumes
exactly, `final/` (merged) and `final_adapter/` load in transformers, bad input is one line.

References: transformers' GPT2LMHeadModel (with peft's PeftModel for the adapter), the base weights the
run started from, and an uninterrupted run. The base is a random tiny GPT-2 saved by transformers.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    TINY,
    assert_same_weights,
    assert_weights_within_rounding,
    launch,
    resume_copy,
    run_in_process,
    train_in_process,
    tree_digest,
)
from safetensors.torch import load_file

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@pytest.fixture(scope="module")
def base(tiny_hf_gpt2) -> Path:
    """The session's tiny random GPT-2 saved by transformers (conftest.py)."""
    return tiny_hf_gpt2


def lora_args(base: Path, rank: int = 4) -> list[str]:
    """rank 0: the same run as a full fine-tune. No dropout: the 2-process run resumed on 1 process must follow
    the same arithmetic as the reference."""
    return TINY + ["--init_from", str(base), "--lora_rank", str(rank), "--lr", "2e-2", "--max_steps", "4",
                   "--micro_batch_size", "2", "--total_batch_size", "128", "--save_every", "2", "--log_every", "1",
                   "--eval_every", "4"]


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory):
    """An uninterrupted LoRA run that pushes to a fake Hub at the end; returns its folder and the pushed files."""
    from fake_hub import FakeHub

    out = tmp_path_factory.mktemp("lora") / "run"
    hf_home = tmp_path_factory.mktemp("hf_home")
    with FakeHub() as hub:
        push = ["--push_to_hub", "true", "--hub_model_id", "alice/lora"]
        proc = launch(lora_args(base) + ["--out_dir", str(out), *push],
                      extra_env={"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_x", "HF_HUB_OFFLINE": "0",
                                 "HF_HOME": str(hf_home)})
        pushed = hub.files("alice/lora")
        assert hub.unknown == []
    assert "(LoRA r=4 on c_attn,c_proj,c_fc: 4,096 trainable" in proc.stdout  # 2 layers x (4x32 + 96x4 + ...)
    assert "\r" not in proc.stderr and "Writing model shards" not in proc.stderr  # no library bars in a log
    return out, pushed


@pytest.mark.slow
def test_only_the_adapters_train_and_checkpoints_hold_only_them(base, reference):
    """A LoRA checkpoint holds the adapter and its optimizer state, no base weights (under 1/20 of the base).

    Seen to catch: the save hook keeping the full model (`weights.pop` removed): `model.safetensors` found in the
    checkpoint."""
    out, _ = reference
    base_weights, merged = load_file(base / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    for key, tensor in base_weights.items():
        if key.endswith(CONV1D):  # the targeted projections: base + B A
            assert not torch.equal(merged[key], tensor), key
        elif key in merged:  # embeddings (wpe cut to --block_size), LayerNorms, biases: frozen, bit for bit
            assert torch.equal(merged[key], tensor[: len(merged[key])]), key
    checkpoint = out / "checkpoints" / "step_000004"
    assert not (checkpoint / "model.safetensors").exists()
    adapter = load_file(checkpoint / "adapter_model.safetensors")
    assert sum(t.numel() for t in adapter.values()) == 4096 and all(".lora_" in k for k in adapter)
    size = sum(p.stat().st_size for p in checkpoint.iterdir())
    assert size < (base / "model.safetensors").stat().st_size / 20, size  # the base alone is 6.5 MB here


@pytest.mark.slow
def test_final_and_final_adapter_give_the_merged_models_logits_in_transformers(base, reference):
    """`final/` loads in transformers and `final_adapter/` on `GPT2LMHeadModel` through `PeftModel`, both with our
    merged model's logits.

    Seen to catch: `fan_in_fan_out: false` in `final_adapter/` is not caught by the logits (peft sees Conv1D and sets it
    itself, with a warning); the test now also checks the config field and the base's name."""
    from peft import PeftModel
    from transformers import GPT2LMHeadModel

    from model import GPT

    out, _ = reference
    x = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = GPT.from_pretrained(out / "checkpoints" / "step_000004").eval()  # the checkpoint: base + adapter, merged
    with torch.no_grad():
        expected = ours(x, all_logits=True)[0]
        final = GPT2LMHeadModel.from_pretrained(out / "final").eval()(x).logits
        adapted = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), out / "final_adapter").eval()
        with_adapter = adapted(x).logits
        plain = GPT2LMHeadModel.from_pretrained(base).eval()(x).logits
    torch.testing.assert_close(final, expected, atol=1e-5, rtol=0)
    adapter_config = json.loads((out / "final_adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base) and adapter_config["fan_in_fan_out"] is True
    torch.testing.assert_close(with_adapter, expected, atol=1e-5, rtol=0)
    assert (plain - expected).abs().max() > 1e-2  # the adapter changed the model


@pytest.mark.slow
def test_the_hub_push_holds_the_merged_model_and_the_adapter(reference):
    """The Hub push holds the merged model and the adapter (`adapter/`).

    Seen to catch: not broken on purpose (a new test)."""
    out, pushed = reference
    assert pushed["model.safetensors"] == (out / "final" / "model.safetensors").read_bytes()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert pushed[f"adapter/{name}"] == (out / "final_adapter" / name).read_bytes(), name


@pytest.mark.slow
def test_a_lora_run_resumes_its_own_checkpoint_bit_exact(base, reference, tmp_path):
    """Resumed from its checkpoint of step 2 (the adapters and their optimizer state only; conftest.resume_copy):
    final/ and final_adapter/ byte-equal to the uninterrupted run's.

    With 2 processes too, and the 2-process LoRA run equals the 1-process one to float rounding
    (`test_two_process_lora_run_resumes_bit_exact_and_equals_one_process`).

    Seen to catch: the load hook not loading the adapter: weights 0.09 apart. Also caught: `adapter_config.json`'s
    `target_modules` in set order, which differs between processes (now sorted)."""
    out = tmp_path / "run"
    launch(lora_args(base) + resume_copy(reference[0], 2, out))
    assert_same_weights(reference[0], out)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (out / "final_adapter" / name).read_bytes() == (reference[0] / "final_adapter" / name).read_bytes()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_process_lora_run_resumes_bit_exact_and_equals_one_process(base, reference, tmp_path):
    """2 processes, uninterrupted vs resumed on 2 processes from its own checkpoint of step 2 (written by both
    ranks, adapters only): bit for bit. The uninterrupted 2-process run equals the 1-process reference (the same
    global batches) to float rounding."""
    whole, out = tmp_path / "whole", tmp_path / "run"
    launch(lora_args(base) + ["--out_dir", str(whole)], nproc=2)
    assert not (whole / "checkpoints" / "step_000002" / "model.safetensors").exists()
    launch(lora_args(base) + resume_copy(whole, 2, out), nproc=2)
    assert_same_weights(whole, out)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (out / "final_adapter" / name).read_bytes() == (whole / "final_adapter" / name).read_bytes()
    assert_weights_within_rounding(reference[0], whole)


@pytest.mark.slow
def test_final_adapter_loads_by_itself_through_auto_peft_model(base, tmp_path, monkeypatch):
    """The user's case: a LoRA run on a run of ours (`--init_from` a run folder, whose final/ is the tiny GPT-2),
    given as a relative path. peft's AutoPeftModelForCausalLM loads final_adapter/ with nothing else (the base is
    the folder its config names), from another working directory, and gives final/'s merged logits.

    A Hub base is named at the commit the run downloaded
    (`test_final_adapter_names_a_hub_base_at_the_commit_the_run_downloaded`).

    Seen to catch: the base's name no longer rewritten in `save_adapter_folder`: `ValueError: Unrecognized model in
    .../pretrained` (the user's error). The Hub base named at `weights.revision`: `main` instead of the commit."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    shutil.copytree(base, tmp_path / "pretrained" / "final")
    monkeypatch.chdir(tmp_path)
    train_in_process(lora_args(Path("pretrained")) + ["--out_dir", "lora"])
    monkeypatch.chdir(tmp_path / "lora")  # a base named relative to where the run started would not be found here
    x = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "lora" / "final_adapter").eval()(x).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "final").eval()(x).logits
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(x).logits
    torch.testing.assert_close(adapted, merged, atol=1e-5, rtol=0)
    assert (plain - merged).abs().max() > 1e-2  # the adapter changed the model


def test_final_adapter_names_a_hub_base_at_the_commit_the_run_downloaded(tmp_path):
    from checkpoint_io.weights import Kind, Weights
    from model.lora import loadable_base

    commit = "0123456789abcdef0123456789abcdef01234567"
    downloaded = Weights(Kind.HUB, "gpt2", tmp_path / "models--gpt2" / "snapshots" / commit, revision="main")
    assert loadable_base(downloaded) == ("gpt2", commit)


def test_only_adapter_matrices_get_gradients():
    """Only the adapter matrices get gradients; after training every non-targeted weight equals the base bit for bit
    (`test_only_the_adapters_train_and_checkpoints_hold_only_them`).

    Seen to catch: every parameter set trainable after `inject_adapter_in_model`: both fail (gradients on `wte`;
    1,640,320 trainable in the header)."""
    from model import GPT, GPTConfig
    from model.lora import add_adapters, lora_config

    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=100))
    add_adapters(model, lora_config(4, 8.0, 0.0, ["c_attn", "c_proj", "c_fc"], "base"))
    x = torch.randint(0, 100, (2, 16))
    model(x, x)[1].backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (".lora_" in name), name
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if ".lora_B" in n)


# ---- bad input: one line, exit 2, nothing written ---------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--lora_rank", "-1"], "--lora_rank must be 0 (full fine-tuning) or a rank of at least 1, got -1"),
    (["--lora_rank", "4", "--init_from", "scratch"], "--lora_rank trains adapters on pretrained weights"),
    (["--lora_rank", "33"], "--lora_rank 33 does not fit: the targeted layers have 32 features on their smallest side"),
    (["--lora_rank", "4", "--lora_targets", "q_proj,v_proj"],
     "--lora_targets q_proj, v_proj matches no layer of the model; choose among c_attn, c_fc, c_proj"),
    (["--lora_rank", "4", "--lora_targets", "lm_head"],
     "matches lm_head, which is not a linear layer of a transformer"),
    (["--lora_rank", "4", "--optimizer", "muon"], "--lora_rank trains its adapters with AdamW only"),
])
def test_bad_lora_flags(monkeypatch, capsys, tmp_path, base, flags, message):
    """Bad LoRA input is one line, nothing written, LoRA with `--optimizer muon` included; LoRA and full checkpoints
    never resume into each other (`test_lora_and_full_checkpoints_do_not_mix`).

    Seen to catch: `check_resume` disabled: the full resume then fails inside accelerate on a missing
    `pytorch_model.bin`. The Muon message is pinned, not broken."""
    args = TINY + ["--init_from", str(base), "--out_dir", str(tmp_path / "r"), *flags]
    assert message in run_in_process(monkeypatch, capsys, args)
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_lora_and_full_checkpoints_do_not_mix(monkeypatch, capsys, tmp_path, base, reference):
    lora_run = reference[0]
    before = tree_digest(lora_run)
    resume = ["--out_dir", str(lora_run), "--resume", "latest"]
    assert "is a checkpoint of a LoRA run (adapters only); resume it with the flags" in \
        run_in_process(monkeypatch, capsys, lora_args(base, rank=0) + resume)
    assert "was trained with other LoRA settings (lora_rank: checkpoint 4 vs now 8)" in \
        run_in_process(monkeypatch, capsys, lora_args(base, rank=8) + resume)
    assert tree_digest(lora_run) == before

    # A full fine-tune's checkpoint (its two JSON files are all that is read before the refusal).
    full_run = tmp_path / "full"
    checkpoint = full_run / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    for name in ("gpt_config.json", "run_state.json"):
        shutil.copy(lora_run / "checkpoints" / "step_000004" / name, checkpoint / name)
    args = lora_args(base) + ["--out_dir", str(full_run), "--resume", "latest"]
    assert "is a checkpoint of a full fine-tune (every weight), not of a LoRA run" in \
        run_in_process(monkeypatch, capsys, args)


def test_the_header_counts_a_few_thousand_adapter_weights_as_they_are():
    """The optimizer line of a LoRA run on a tiny model. Seen to catch (issue 60): "on all 0.00M trainable params"
    for 4,096; a count under 100,000 is written out, a larger one in millions."""
    from configs import ModelConfig, OptimConfig
    from model import GPT, GPTConfig
    from model.lora import add_adapters, lora_config
    from training.optimizers.plan import describe_optimizers, plan_optimizers

    model = add_adapters(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)),
                         lora_config(4, 16.0, 0.0, ["c_attn", "c_proj", "c_fc"], "base"))
    plan = plan_optimizers(OptimConfig(), ModelConfig(init_from="gpt2", lora_rank=4))
    assert describe_optimizers(model, plan).endswith("on all 4,096 trainable params")
    for p in model.parameters():
        p.requires_grad = True
    assert describe_optimizers(model, plan).endswith(f"on all {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
                                                     "trainable params")
