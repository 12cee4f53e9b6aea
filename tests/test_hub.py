"""Publishing: the real huggingface_hub client pushes a run to a Hub-compatible server on loopback.

What arrives is checked independently: file list, the card's YAML metadata, weights that
transformers' pipeline loads offline and that generate what our GPT generates, and a token that
travels only in the Authorization header.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import huggingface_hub.constants as hf_constants
import pytest
import torch
import yaml
from fake_hub import FakeHub
from safetensors.torch import save_file

from common.errors import UserError
from common.run_dir import RunDir
from model import GPT, GPTConfig
from publish.card_content import recorded_source, render_card
from publish.hub import main as hub_cli
from publish.hub import push_to_hub

SECRET = "hf_TestSecretToken_3e9b71c2d4"
REPO = "alice/tiny-shakespeare-gpt"
CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)
TRAIN_CONFIG = {"model": "tiny", "dataset": "shakespeare", "max_steps": 20, "learning_rate": 6e-4,
                "micro_batch_size": 4, "out_dir": "out/tiny"}


def _metrics() -> list[dict]:
    rows = []
    for step in range(1, 21):
        row = {"step": step, "loss": 10.8 - 0.2 * step, "lr": 6e-4, "grad_norm": 1.5, "tokens": step * 4096,
               "tok_per_sec": 5000.0, "mfu": None}
        if step % 10 == 0:
            row["val_loss"] = 9.0 - 0.05 * step
        if step == 20:
            row.update(hellaswag_acc=0.255, hellaswag_acc_norm=0.2625)
        rows.append(row)
    return rows


def _checkpoint(model: GPT, folder: Path, step: int) -> None:
    """A checkpoint as the trainer lays it out (accelerate drops the tied lm_head from model.safetensors)."""
    folder.mkdir(parents=True)
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "gpt_config.json").write_text(json.dumps(asdict(model.config)))
    (folder / "run_state.json").write_text(json.dumps({"step": step, "tokens": step * 4096, "world_size": 1}))
    (folder / "optimizer.bin").write_bytes(b"optimizer state stand-in")
    (folder / "data_state_rank0.json").write_text(json.dumps({"position": step * 16}))


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    """A finished tiny run: config.yaml, metrics.jsonl, two checkpoints, final/ (built once, copied per test)."""
    run = tmp_path_factory.mktemp("template") / "run"
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(TRAIN_CONFIG))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _metrics()))
    old = GPT(CONFIG)  # an older checkpoint with other weights: must never be the one pushed
    _checkpoint(old, run / "checkpoints" / "step_000010", 10)
    _checkpoint(model, run / "checkpoints" / "step_000020", 20)
    model.save_pretrained(run / "final")
    return run, model


@pytest.fixture
def run_dir(template: tuple[Path, GPT], tmp_path: Path) -> Path:
    return Path(shutil.copytree(template[0], tmp_path / "run"))


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    # conftest makes the session offline; this module's client must talk to the loopback server.
    # huggingface_hub reads HF_HUB_OFFLINE, HF_ENDPOINT and the login-cache path once, at import (as a
    # user's process does when they are set before it starts): patch its constants.
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no_login_cache" / "token"))
    with FakeHub() as server:
        _point_client_at(monkeypatch, server.url)
        yield server
    assert server.unknown == [], f"client called endpoints the fake hub does not know: {server.unknown}"


def _point_client_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    monkeypatch.setattr(hf_constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(hf_constants, "HF_URL_HOSTS", hf_constants.HF_URL_HOSTS | {"127.0.0.1"})


def _card_metadata(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def _all_bytes(folder: Path) -> list[tuple[Path, bytes]]:
    return [(p, p.read_bytes()) for p in folder.rglob("*") if p.is_file()]


@pytest.mark.slow  # imports transformers' pipeline and generates: about 15 s
def test_push_finished_run_is_usable_and_keeps_the_token_secret(hub, run_dir, template, tmp_path, capfd):
    url = push_to_hub(run_dir, REPO)
    assert url == f"{hub.url}/{REPO}"

    files = hub.files(REPO)
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md", "loss_curve.png",
            "tokenizer_config.json"} <= set(files)
    assert not any(name.startswith("training_state/") for name in files)
    assert files["model.safetensors"] == (run_dir / "final" / "model.safetensors").read_bytes()
    assert files["loss_curve.png"].startswith(b"\x89PNG\r\n\x1a\n")

    card = files["README.md"].decode()
    meta = _card_metadata(card)
    assert meta["license"] == "mit" and meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-generation" and meta["datasets"] == ["karpathy/tiny_shakespeare"]
    assert "gpt2" in meta["tags"]
    assert "| tokens seen | 81,920 | 20 |" in card  # the last logged `tokens`
    assert "| validation loss | 8.0000 | 20 |" in card and "| HellaSwag acc_norm | 0.2625 | 20 |" in card
    assert "![Training curves: loss, HellaSwag, learning rate](loss_curve.png)" in card
    assert "learning_rate: 0.0006" in card

    # Someone who never saw this project: pipeline() on the downloaded repo, offline.
    from transformers import pipeline

    from data import get_tokenizer

    pushed = hub.write_to(tmp_path / "download", REPO)
    generator = pipeline("text-generation", model=str(pushed), device="cpu")
    prompt = "To be, or not to be"
    out = generator(prompt, max_new_tokens=12, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    ids = torch.tensor([get_tokenizer().encode(prompt)])
    with torch.no_grad():
        ours = template[1].generate(ids, max_new_tokens=12, temperature=0.0)
    assert list(out) == ours[0].tolist()

    # The token went where it must (the Authorization header of every write) and nowhere else.
    writes = [r for r in hub.requests if r.method == "POST"]
    assert writes and all(r.headers.get("authorization") == f"Bearer {SECRET}" for r in writes)
    leaks = [p for p, data in _all_bytes(run_dir) + _all_bytes(pushed) if SECRET.encode() in data]
    assert leaks == []
    captured = capfd.readouterr()
    assert SECRET not in captured.out and SECRET not in captured.err


def test_interrupted_run_goes_to_a_branch_with_its_training_state(hub, run_dir, template, tmp_path):
    shutil.rmtree(run_dir / "final")
    url = push_to_hub(run_dir, REPO, revision="step-20", private=True, include_state=True,
                      commit_message="checkpoint 20")
    assert url == f"{hub.url}/{REPO}/tree/step-20"
    assert hub.private[REPO] and hub.commits[-1]["summary"] == "checkpoint 20"
    assert set(hub.files(REPO, "main")) == {".gitattributes"}  # only the branch got the commit

    files = hub.files(REPO, "step-20")
    ckpt = run_dir / "checkpoints" / "step_000020"
    state = {f"training_state/{p.name}": p.read_bytes() for p in ckpt.iterdir()}
    assert {k: v for k, v in files.items() if k.startswith("training_state/")} == state
    card = files["README.md"].decode()
    assert "checkpoint step_000020" in card and 'revision="step-20"' in card and "training_state/" in card

    # The exported weights are those of the newest checkpoint, as HF's GPT-2 reads them.
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(hub.write_to(tmp_path / "dl", REPO, "step-20")).eval()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours_last, _ = template[1](ids)
        _, ours_loss = template[1](ids[:, :-1], targets=ids[:, 1:])  # covers every position
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs[:, -1:], ours_last, atol=1e-4, rtol=1e-4)
    theirs_loss = torch.nn.functional.cross_entropy(theirs[:, :-1].reshape(-1, theirs.size(-1)), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(theirs_loss, ours_loss, atol=1e-5, rtol=1e-5)


def test_a_training_state_that_would_not_resume_is_not_pushed(hub, run_dir):
    """--include_state uploads the newest checkpoint for a later resume: each of its files is checked against its
    manifest as a resume checks it (a lost optimizer state stops the push, not only the weights' files), one line,
    nothing pushed.

    Seen to catch: the check off: `DID NOT RAISE`."""
    from checkpoint_io.manifest import write_manifest

    shutil.rmtree(run_dir / "final")
    newest = run_dir / "checkpoints" / "step_000020"
    write_manifest(newest)
    (newest / "optimizer.bin").write_bytes(b"optimizer state stand-In")  # other bytes, the same size
    with pytest.raises(UserError, match=r"^--include_state: checkpoint file \S+/step_000020/optimizer.bin is damaged "
                                        r"\(its sha256 differs from the one saved\), so it would not resume; push "
                                        r"without --include_state"):
        push_to_hub(run_dir, REPO, include_state=True)
    assert hub.commits == []


@pytest.mark.parametrize("repo_exists", [False, True], ids=["new-repo", "someone-elses-repo"])
def test_forbidden_push_keeps_the_export_and_a_retry_only_uploads(hub, run_dir, monkeypatch, repo_exists):
    shutil.rmtree(run_dir / "final")
    if repo_exists:  # create_repo answers 403, finds the repo readable, and the commit itself is refused
        hub.repos[REPO], hub.private[REPO] = {"main": {}}, False
    before = sorted((str(p), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file())
    hub.deny_status = 403
    with pytest.raises(UserError, match=r"no write access to alice/tiny-shakespeare-gpt.*403.*retry with") as err:
        push_to_hub(run_dir, REPO, private=True)
    assert str(err.value).endswith(f"--hub_model_id {REPO} --private")  # a retry must not create a public repo
    assert "\n" not in str(err.value)
    assert hub.repos.get(REPO, {}).get("main", {}) == {}
    assert any(r.path.endswith("/preupload/main") for r in hub.requests) == repo_exists
    weights = RunDir(run_dir).hub_export / "model" / "model.safetensors"
    assert weights.is_file()
    # The run itself is untouched: only hub_export/ was added.
    after = sorted((str(p), p.stat().st_mtime_ns) for p in run_dir.rglob("*")
                   if p.is_file() and "hub_export" not in p.parts)
    assert after == before

    hub.deny_status = None
    stamp = weights.stat().st_mtime_ns

    def no_reexport(*args, **kwargs):
        raise AssertionError("the retry exported the checkpoint again")

    monkeypatch.setattr(GPT, "from_pretrained", no_reexport)
    push_to_hub(run_dir, REPO)
    assert weights.stat().st_mtime_ns == stamp
    assert hub.files(REPO)["model.safetensors"] == weights.read_bytes()


def test_newer_checkpoint_replaces_a_stale_export(hub, run_dir, template, capsys):
    shutil.rmtree(run_dir / "final")
    shutil.rmtree(run_dir / "checkpoints" / "step_000020")
    push_to_hub(run_dir, REPO, revision="step-10")
    first = hub.files(REPO, "step-10")["model.safetensors"]
    _checkpoint(template[1], run_dir / "checkpoints" / "step_000030", 30)
    assert RunDir(run_dir).latest_checkpoint().name == "step_000030"
    hub_cli(["--run_dir", str(run_dir), "--hub_model_id", REPO, "--revision", "step-30"])
    assert capsys.readouterr().out == f"pushed {run_dir} to {hub.url}/{REPO}/tree/step-30\n"
    second = hub.files(REPO, "step-30")["model.safetensors"]
    assert second != first and "step_000030" in hub.files(REPO, "step-30")["README.md"].decode()


def test_no_token_is_a_user_error_before_any_request(hub, run_dir, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(UserError, match="no Hugging Face token found; set HF_TOKEN"):
        push_to_hub(run_dir, REPO)
    assert hub.requests == []


def test_unreachable_hub_is_a_user_error(hub, run_dir, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    _point_client_at(monkeypatch, dead)
    with pytest.raises(UserError, match=f"could not reach the Hub at {dead}"):
        push_to_hub(run_dir, REPO)
    assert (RunDir(run_dir).hub_export / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("bad", ["no-namespace", "a/b/c", "user/../x", "user/name with space"])
def test_bad_repo_id_is_a_user_error(hub, run_dir, bad):
    with pytest.raises(UserError, match="is not a Hub repo id"):
        push_to_hub(run_dir, bad)


@pytest.mark.slow
def test_cli_reports_a_missing_run_in_one_line(tmp_path):
    env = {"HF_TOKEN": SECRET, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "PATH": "/usr/bin:/bin",
           "HF_ENDPOINT": "http://127.0.0.1:9"}
    proc = subprocess.run([sys.executable, "-m", "publish.hub", "--run_dir", str(tmp_path / "nope"),
                           "--hub_model_id", REPO], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: run folder {tmp_path / 'nope'} does not exist; "
                                                "pass the --out_dir of a training run as --run_dir"]


def test_card_masks_credentials_and_maps_datasets():
    config = {"dataset": "HuggingFaceFW/fineweb-edu:sample-10BT", "wandb": {"api_key": "wandb-xyz"},
              "hf_token": "hf_abc", "max_tokens": 100, "tokenizer": "gpt2", "init_from": "gpt2"}
    card = render_card(REPO, config, {}, {}, source="the final weights of the run")
    meta = _card_metadata(card)
    assert meta["datasets"] == ["HuggingFaceFW/fineweb-edu"] and meta["base_model"] == "openai-community/gpt2"
    assert "wandb-xyz" not in card and "hf_abc" not in card
    assert "max_tokens: 100" in card and "tokenizer: gpt2" in card
    assert "No metrics were logged" in card and "HellaSwag" not in card
    # a local path names no Hub dataset (one that is no longer there names nothing: the card says it as written)
    assert all(getattr(recorded_source({"dataset": local}), "hub_id", None) is None
               for local in ("data/corpus.txt", "shards/*.parquet"))
