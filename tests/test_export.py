"""save_pretrained -> transformers, the exported tokenizer, loading our checkpoint and run folders,
and the one-line errors for bad model sources."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.cache_dir import CACHE_ENV
from common.errors import UserError
from data import get_tokenizer
from model import GPT, GPTConfig

CFG = dict(n_layer=2, n_head=2, n_embd=32, block_size=32)  # GPT-2's vocabulary, padded to 50304
TEXT = (
    "Hello world! It's  a test:\n\n  naïve café, 東京 and 🤖\t\ttabs. 1234567 + 3.14 = ???\n"
    "<|endoftext|>They'll say we've DONE it... didn't they?   \r\n  ends with spaces   "
)


def trained_like(seed: int = 0, **overrides) -> GPT:
    """A tiny model whose biases and LayerNorms are not at their init values."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**CFG, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[GPT, Path]:
    model = trained_like()
    folder = tmp_path_factory.mktemp("export") / "final"
    model.save_pretrained(folder)
    return model, folder


def same_weights(a: GPT, b: GPT) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_export_loads_in_transformers_with_same_logits(exported):
    """The export loads in transformers with the same logits.

    Seen to catch: the Conv1D transpose dropped from `save_pretrained`."""
    from transformers import AutoModelForCausalLM

    model, folder = exported
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # still tied
    x = torch.randint(0, 50257, (2, 20))
    with torch.no_grad():
        ref = hf(x).logits
        ours, _ = model(x, all_logits=True)
    assert (ref - ours).abs().max() < 1e-5
    config = json.loads((folder / "config.json").read_text())
    assert config["activation_function"] == "gelu_new" and config["n_positions"] == config["n_ctx"] == 32
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 50256 and generation["max_length"] == 32  # the context, for every client


def test_export_round_trips_to_our_model(exported):
    model, folder = exported
    back = GPT.from_pretrained(folder)
    assert back.config == model.config
    assert same_weights(back, model)  # padding rows are zero, so dropping them loses nothing
    assert back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()


def test_export_without_bias_round_trips(tmp_path):
    from transformers import AutoModelForCausalLM

    model = trained_like(bias=False, pad_vocab_multiple=1)
    model.save_pretrained(tmp_path / "nobias")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "nobias").eval()
    x = torch.randint(0, 50257, (1, 12))
    with torch.no_grad():
        assert (hf(x).logits - model(x, all_logits=True)[0]).abs().max() < 1e-5
    back = GPT.from_pretrained(tmp_path / "nobias")
    assert back.config == model.config and same_weights(back, model)


def test_exported_tokenizer_gives_tiktoken_ids(exported):
    from transformers import AutoTokenizer

    _, folder = exported
    tok = AutoTokenizer.from_pretrained(folder)
    enc = get_tokenizer()
    ids = enc.encode(TEXT, allowed_special="all")
    assert tok(TEXT)["input_ids"] == ids
    assert tok.decode(ids) == TEXT
    assert tok.eos_token_id == 50256 and tok.model_max_length == 32


def test_classic_vocab_and_merges_files_encode_the_same(exported):
    """vocab.json + merges.txt alone (what older tools read) give tiktoken's ids too."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    _, folder = exported
    lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("#version") and len(lines) == 1 + 50000 and lines[1] == "Ġ t"
    tok = Tokenizer(BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = TEXT.replace("<|endoftext|>", "")  # a special token, not BPE
    assert tok.encode(text).ids == get_tokenizer().encode_ordinary(text)


def _tokenizer_files(folder: Path) -> dict[str, bytes]:
    from data.hf_tokenizer import TOKENIZER_FILES

    return {name: (folder / name).read_bytes() for name in TOKENIZER_FILES}


def test_the_tokenizer_files_are_built_once_then_copied_from_the_cache(tmp_path, monkeypatch):
    """The first export of a context length builds the tokenizer files in the cache (common/cache_dir.py) and copies
    them; the next copies them without building; a cached folder with a file emptied (a machine's crash after the
    rename) is built again; another context length is another folder. (That a copy holds what a build in the
    export's own folder writes: the next test.)

    Seen to catch: the check of every file dropped (`if folder.is_dir()`): the damaged folder is copied as it is.
    The check of each file's size dropped: the export gets the empty tokenizer.json."""
    from data import hf_tokenizer

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    builds = []
    build = hf_tokenizer._build_tokenizer
    monkeypatch.setattr(hf_tokenizer, "_build_tokenizer", lambda d, n: (builds.append(n), build(d, n)))
    for name, length in (("a", 32), ("b", 32), ("c", 64)):
        (tmp_path / name).mkdir()
        hf_tokenizer.save_tokenizer(tmp_path / name, length)
    assert builds == [32, 64]
    assert _tokenizer_files(tmp_path / "a") == _tokenizer_files(tmp_path / "b")
    assert json.loads((tmp_path / "c" / "tokenizer_config.json").read_text())["model_max_length"] == 64
    [cached] = [f for f in (tmp_path / "cache").iterdir() if '"model_max_length": 32' in
                (f / "tokenizer_config.json").read_text()]
    (cached / "tokenizer.json").write_bytes(b"")
    (tmp_path / "d").mkdir()
    hf_tokenizer.save_tokenizer(tmp_path / "d", 32)
    assert builds == [32, 64, 32] and _tokenizer_files(tmp_path / "d") == _tokenizer_files(tmp_path / "a")
    assert _tokenizer_files(cached) == _tokenizer_files(tmp_path / "a")  # repaired
    assert [p.name.startswith(".tmp-") for p in (tmp_path / "cache").iterdir()] == [False, False]


def test_an_unwritable_cache_or_a_process_that_builds_it_first_still_gives_the_files(tmp_path, monkeypatch):
    """A cache that cannot be created (here a file stands where it should be) leaves the export to build the files
    in its own folder; when another process renames its copy into place first, ours is discarded and theirs, left
    as it is, copied. Both give the same bytes.

    Seen to catch: the `except OSError: return None` around the cache's creation removed: the export fails. The
    completeness check before replacing a cached folder removed: the other process's folder is deleted."""
    from data import hf_tokenizer

    (tmp_path / "not_a_folder").write_text("")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "not_a_folder" / "cache"))
    (tmp_path / "a").mkdir()
    hf_tokenizer.save_tokenizer(tmp_path / "a", 32)

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    build = hf_tokenizer._build_tokenizer

    def another_process_wins(directory: Path, length: int) -> None:
        build(directory, length)
        monkeypatch.setattr(hf_tokenizer, "_build_tokenizer", build)
        theirs = hf_tokenizer._cached_tokenizer(length)  # the other process, start to end: it renames first
        (theirs / "theirs").write_text("")

    monkeypatch.setattr(hf_tokenizer, "_build_tokenizer", another_process_wins)
    (tmp_path / "b").mkdir()
    hf_tokenizer.save_tokenizer(tmp_path / "b", 32)
    assert _tokenizer_files(tmp_path / "b") == _tokenizer_files(tmp_path / "a")
    [cached] = (tmp_path / "cache").iterdir()
    assert (cached / "theirs").exists()


def test_pipeline_generates_offline(exported):
    from transformers import pipeline

    _, folder = exported
    out = pipeline("text-generation", model=str(folder))("Hello world", max_new_tokens=5, do_sample=False)
    text = out[0]["generated_text"]
    assert text.startswith("Hello world") and len(text) > len("Hello world")


@pytest.mark.slow  # 126 sampled tokens through transformers' generate: 4-15 s on 2 cores
def test_pipeline_without_length_arguments_stays_within_the_context(tmp_path):
    """transformers' pipeline adds 256 new tokens by default: a 128-position export generates up to its context, as
    its generation_config.json says (`max_length`), and config.json names the context as llama.cpp's converter reads
    it (`n_ctx`). Seen to catch: without `max_length` the pipeline ran past the position table (IndexError)."""
    from transformers import pipeline

    torch.manual_seed(0)
    GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=128)).save_pretrained(tmp_path / "m")
    generator = pipeline("text-generation", model=str(tmp_path / "m"))
    out = generator("Hello world", return_tensors=True)[0]["generated_token_ids"]
    assert len(out) == 128 or (len(out) < 128 and out[-1] == 50256)  # the context, or an end-of-text before it
    assert json.loads((tmp_path / "m" / "config.json").read_text())["n_ctx"] == 128
    assert json.loads((tmp_path / "m" / "generation_config.json").read_text())["max_length"] == 128


def test_export_never_overwrites(exported):
    model, folder = exported
    with pytest.raises(UserError, match="already holds a model; choose a new folder or pass overwrite=True"):
        model.save_pretrained(folder)


def write_checkpoint(folder: Path, model: GPT, prefix: str = "_orig_mod.") -> None:
    """What the trainer's checkpoint holds: gpt_config.json + accelerate's safetensors of the
    (compiled) model's state dict, the tied lm_head.weight dropped."""
    folder.mkdir(parents=True)
    (folder / "gpt_config.json").write_text(json.dumps(model.config.__dict__))
    state = {prefix + k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, folder / "model.safetensors")


def test_loads_training_checkpoint_folder(tmp_path):
    model = trained_like(dropout=0.1)
    write_checkpoint(tmp_path / "step_000010", model, prefix="module._orig_mod.")
    back = GPT.from_pretrained(tmp_path / "step_000010")
    assert back.config == model.config and same_weights(back, model)
    assert GPT.from_pretrained(tmp_path / "step_000010", dropout=0.0).config.dropout == 0.0


def test_loads_newest_checkpoint_then_final_of_a_run(tmp_path):
    run = tmp_path / "run"
    old, new = trained_like(seed=1), trained_like(seed=2)
    write_checkpoint(run / "checkpoints" / "step_000100", old)
    write_checkpoint(run / "checkpoints" / "step_000200", new)
    (run / "checkpoints" / "step_000300").mkdir()  # not complete: no gpt_config.json
    assert same_weights(GPT.from_pretrained(run), new)
    final = trained_like(seed=3)
    final.save_pretrained(run / "final")
    assert same_weights(GPT.from_pretrained(run), final)


def test_smaller_block_size_crops_positions(exported):
    model, folder = exported
    small = GPT.from_pretrained(folder, block_size=16)
    assert small.config.block_size == 16 and small.transformer.wpe.weight.shape[0] == 16
    x = torch.randint(0, 50257, (1, 16))
    with torch.no_grad():
        assert torch.allclose(small(x, all_logits=True)[0], model(x, all_logits=True)[0], atol=1e-6)


def test_loads_unprefixed_openai_style_keys(tmp_path):
    """OpenAI's original GPT-2 files on the Hub name tensors `h.0.attn...` (no `transformer.`) and
    carry the causal-mask buffers `h.N.attn.bias`."""
    from safetensors.torch import load_file

    model, _ = trained_like(), None
    model.save_pretrained(tmp_path / "hf")
    state = load_file(tmp_path / "hf" / "model.safetensors")
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    state.update({f"h.{i}.attn.bias": torch.ones(1, 1, 32, 32) for i in range(2)})
    save_file(state, tmp_path / "hf" / "model.safetensors")
    assert same_weights(GPT.from_pretrained(tmp_path / "hf"), model)


# --- bad inputs: one line saying what to do -------------------------------------------------


def test_block_size_above_positions(exported):
    _, folder = exported
    with pytest.raises(UserError,
                       match=r"block_size=64 exceeds the 32 positions of .*; use a block_size of at most 32"):
        GPT.from_pretrained(folder, block_size=64)


def test_hub_id_while_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(tmp_path)  # no ./gpt2 folder can shadow the Hub id
    for name in ("gpt2", "openai-community/gpt2-xl", "gpt5"):
        with pytest.raises(UserError,
                           match=rf"cannot fetch '{name}' from the Hugging Face Hub: offline .* pass a local folder"):
            GPT.from_pretrained(name)


def test_missing_path_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(UserError, match="is not an existing folder nor a valid Hub model id; known names: gpt2"):
        GPT.from_pretrained(str(tmp_path / "no" / "such" / "run"))


def test_a_mistyped_run_path_is_not_reported_as_a_hub_problem(tmp_path, monkeypatch):
    """A mistyped local run path is not reported as a Hub problem.

    Seen to catch: not broken on purpose (a new test)."""
    (tmp_path / "out" / "my_run").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"^no folder out/my_rnu \(though out/ exists\); check the path"):
        GPT.from_pretrained("out/my_rnu")


def test_not_a_model_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(UserError, match="is neither a model folder .* nor a run folder"):
        GPT.from_pretrained(tmp_path)
    with pytest.raises(UserError, match="is a file; pass the folder"):
        GPT.from_pretrained(tmp_path / "notes.txt")
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(UserError, match="has no final/ export and no checkpoints/step_\\* yet"):
        GPT.from_pretrained(tmp_path)


def test_not_gpt2_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="holds a 'llama' model, not GPT-2"):
        GPT.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="config.json of .* is not valid JSON"):
        GPT.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "activation_function": "relu"}))
    with pytest.raises(UserError, match="GPT-2 variant this model does not implement \\(activation_function='relu'\\)"):
        GPT.from_pretrained(tmp_path)


def test_pickle_only_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(UserError, match=r"no model.safetensors in .*pytorch_model.bin not loaded: pickled weights"):
        GPT.from_pretrained(tmp_path)


def test_weights_that_do_not_fit_the_config(tmp_path, exported):
    _, folder = exported
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(UserError,
                       match=r"does not hold a GPT-2 model of this architecture \(missing \['transformer.h.2"):
        GPT.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    with pytest.raises(UserError, match="weights do not match its config"):
        GPT.from_pretrained(tmp_path)


def test_hub_id_loads_from_the_local_hub_cache(tmp_path, monkeypatch, exported):
    """The Hub path end to end, offline: a repo already in the Hub cache (as after `hf download`)."""
    import shutil

    from huggingface_hub import constants

    model, folder = exported
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--someone--tiny-gpt2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(folder, repo / "snapshots" / commit)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert same_weights(GPT.from_pretrained("someone/tiny-gpt2"), model)
    (repo / "snapshots" / commit / "model.safetensors").unlink()  # a repo with pickled weights only
    with pytest.raises(UserError,
                       match="no model.safetensors in someone/tiny-gpt2; provide the weights as safetensors"):
        GPT.from_pretrained("someone/tiny-gpt2")


def test_fsdp_sharded_and_damaged_checkpoints_are_user_errors(tmp_path):
    from dataclasses import asdict

    from common.errors import UserError

    config = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=128)
    sharded = tmp_path / "fsdp"
    (sharded / "pytorch_model_fsdp_0").mkdir(parents=True)
    (sharded / "gpt_config.json").write_text(json.dumps(asdict(config)))
    with pytest.raises(UserError, match=r"the model shards in .*pytorch_model_fsdp_0 cannot be read "
                                        r"\(CheckpointException\); use another checkpoint"):
        GPT.from_pretrained(sharded)  # an FSDP checkpoint's shards are merged on one process: these are missing
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "gpt_config.json").write_text(json.dumps(asdict(config)))
    (damaged / "model.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    with pytest.raises(UserError, match="are damaged"):
        GPT.from_pretrained(damaged)


def test_the_trainers_export_builds_no_second_model(tmp_path, monkeypatch):
    """train.py's export writes final/ from the trained parameters themselves (issue 32: it built a second GPT to
    hold a copy of them, 0.46 GiB more for GPT-2 124M at the end of a run); the file is the one save_pretrained
    writes, tensor for tensor. And the optimizer state is freed before it (the last checkpoint holds it).

    Seen to catch: the export back to `GPT(arch)` + `load_state_dict`: fails with "the export built a GPT"."""
    from accelerate import Accelerator

    from common.run_dir import RunDir
    from training.checkpoints.export import export_final
    from training.optimizers.plan import release_optimizer_state

    model = trained_like()
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters())
    prepared, optimizer = accelerator.prepare(model, optimizer)
    prepared(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
    optimizer.step()
    optimizer.zero_grad()
    assert len(optimizer.state) == len(list(model.parameters()))  # AdamW's state: every parameter (wte once)
    release_optimizer_state([optimizer])
    assert not optimizer.state and not optimizer.optimizer.state
    model.save_pretrained(tmp_path / "reference")  # the trained weights, as GPT.save_pretrained writes them

    def no_second_model(*args, **kwargs):
        raise AssertionError("the export built a GPT")

    monkeypatch.setattr(GPT, "__init__", no_second_model)
    run = RunDir(tmp_path / "run")
    export_final(accelerator, prepared, model.config, run)
    ref, got = (load_file(folder / "model.safetensors") for folder in (tmp_path / "reference", run.final))
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
