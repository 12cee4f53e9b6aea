"""The lm-eval bridge: on a local HellaSwag-format task the harness scores every ending as eval.hellaswag
does (same log-likelihoods, same acc and acc_norm); our run and checkpoint folders load; results reach
the JSON file and the run's harness.jsonl; a context too short, an unknown task and a missing lm-eval
are one-line errors."""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT
from safetensors.torch import save_file

from common.errors import UserError
from eval.harness import HarnessModel, hub_needs, main, require_lm_eval, resolve_model, run_harness
from eval.hellaswag import evaluate_hellaswag, item_loglikelihoods, load_items
from model import GPT, GPTConfig

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e \".[harness]\")")

TASKS = str(REPO_ROOT / "tests" / "fixtures" / "eval" / "harness_tasks")  # task hellaswag_tiny
ITEMS = REPO_ROOT / "tests" / "fixtures" / "eval" / "hellaswag_tiny.jsonl"


def opinionated_gpt(block_size: int = 64) -> GPT:
    """A random GPT whose scores depend on the words: GPT-2's small init gives near-uniform next-token
    probabilities, under which every scorer just prefers the shortest ending."""
    torch.manual_seed(3)
    model = GPT(GPTConfig(block_size=block_size, n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        model.transformer.wte.weight.normal_(0.0, 1.0)
    return model


@pytest.fixture
def at_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)  # the task YAML names its data file relative to the working directory


@pytest.mark.slow  # the harness loads the model with transformers and builds the task: about 10 s on 2 cores
def test_harness_scores_hellaswag_as_eval_hellaswag_does(tmp_path, at_repo_root):
    model = opinionated_gpt()
    model.save_pretrained(tmp_path / "hf")
    items = load_items(ITEMS)
    ours = evaluate_hellaswag(model, items)
    ours_lls = item_loglikelihoods(model, items)

    output = run_harness(HarnessModel(str(tmp_path / "hf")), ["hellaswag_tiny"], include_path=TASKS, device="cpu",
                         log_samples=True)

    samples = sorted(output["samples"]["hellaswag_tiny"], key=lambda s: s["doc_id"])
    harness_lls = np.array([[ll for ll, _ in sample["filtered_resps"]] for sample in samples])
    np.testing.assert_allclose(harness_lls, ours_lls, rtol=1e-4, atol=1e-3)
    assert [s["acc_norm"] for s in samples] == [float(np.argmax(ll / [len(c) for c in s["doc"]["choices"]])
                                                      == s["target"]) for ll, s in zip(ours_lls, samples)]
    results = output["results"]["hellaswag_tiny"]
    assert results["acc,none"] == ours["acc"]
    assert results["acc_norm,none"] == ours["acc_norm"]
    assert 0 < ours["acc_norm"] < 1  # the model tells the items apart: equal accuracies are no accident


@pytest.mark.slow  # a harness run on two items: about 4 s
def test_cli_on_a_checkpoint_writes_the_json_and_the_runs_harness_log(tmp_path, at_repo_root, capsys):
    model = opinionated_gpt()
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_000020"
    checkpoint.mkdir(parents=True)  # a checkpoint as the trainer lays out its weights (no final/: unfinished)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(checkpoint / "model.safetensors"))
    (checkpoint / "gpt_config.json").write_text(json.dumps(asdict(model.config)))
    (run / "metrics.jsonl").write_text('{"step": 20, "loss": 5.0}\n')

    main(["--model", str(run), "--tasks", "hellaswag_tiny", "--include_path", TASKS, "--limit", "2",
          "--device", "cpu", "--output", str(tmp_path / "results.json")])

    written = json.loads((tmp_path / "results.json").read_text())
    ours = evaluate_hellaswag(model, load_items(ITEMS, limit=2))
    assert written["results"]["hellaswag_tiny"]["acc_norm,none"] == ours["acc_norm"]
    assert written["gpt2_accelerate"] == {"model": str(run), "weights": str(checkpoint)}
    (row,) = [json.loads(line) for line in (run / "harness.jsonl").read_text().splitlines()]
    assert row["weights"] == "checkpoints/step_000020" and row["step"] == 20
    assert row["results"]["hellaswag_tiny"]["acc_norm"] == ours["acc_norm"]
    assert row["n_samples"] == {"hellaswag_tiny": 2}
    assert (run / "metrics.jsonl").read_text() == '{"step": 20, "loss": 5.0}\n'  # the training log is untouched
    assert "acc_norm" in capsys.readouterr().out


def test_our_folders_resolve_to_hf_folders_and_their_run(tmp_path):
    run = tmp_path / "run"
    opinionated_gpt().save_pretrained(run / "final")
    with resolve_model(str(run)) as weights:  # a finished run: final/ as it is, results to the run
        assert (weights.pretrained, weights.run.path, weights.source) == (str(run / "final"), run, run / "final")
    with resolve_model(str(run / "final")) as weights:
        assert weights.run.path == run
    with resolve_model("openai-community/gpt2") as weights:  # a Hub id goes to the harness unchanged
        assert (weights.pretrained, weights.run) == ("openai-community/gpt2", None)


def test_a_hub_revision_reaches_the_harness(tmp_path, monkeypatch):
    """`eval.harness` passes a Hub id's revision to lm-eval, nothing downloaded first. `publish.card` and `publish.hub`
    take only a run's weights: an incomplete checkpoint or an HF folder outside a run is one line
    (`test_model_card.py::test_run_dir_must_name_a_runs_weights`).

    Seen to catch: `revision` left out of lm-eval's `model_args`; the not-a-run check removed from
    `publish.hub.run_weights` (an AttributeError traceback)."""
    import huggingface_hub
    import lm_eval

    seen = {}
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *args, **kwargs: "/cache/config.json")
    monkeypatch.chdir(tmp_path)
    with resolve_model("someone/tiny-gpt2", revision="v1") as model:  # nothing downloaded: lm-eval does that
        run_harness(model, ["hellaswag_tiny"], include_path=TASKS, device="cpu")
    assert seen["model_args"] == {"pretrained": "someone/tiny-gpt2", "revision": "v1"}


def test_only_what_needs_the_hub_is_named():
    """Seen to catch: the old line named the local model among what needs the Hub ("the model /tmp/x, ..."); and
    `HarnessModel(folder)` without `source` taken for a Hub id."""
    local, hub = HarnessModel(str(REPO_ROOT)), HarnessModel("someone/gpt2")  # a folder, a Hub id
    assert hub_needs(local, ["hellaswag_tiny"], ["hellaswag_tiny"]) == []
    assert hub_needs(local, ["hellaswag", "arc_easy"], []) == ["the datasets of hellaswag, arc_easy"]
    assert hub_needs(hub, ["hellaswag_tiny", "hellaswag"], ["hellaswag_tiny"]) == [
        "the model someone/gpt2", "the dataset of hellaswag"]


def test_an_unreachable_hub_is_refused_before_the_harness_starts(tmp_path, monkeypatch):
    """One request, no retries, before the built-in tasks are indexed or the model loaded; only the built-in task's
    dataset is named, not the local model. Seen to catch: without the early check the harness indexed its tasks,
    loaded the model, and its downloads retried (3 min 39 s seen) before the same refusal."""
    import huggingface_hub

    import eval.harness as harness
    from common import network

    class Unreachable:
        def head(self, url, timeout):
            raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(network, "offline_mode", lambda: False)  # the test session's HF_HUB_OFFLINE=1 aside
    monkeypatch.setattr(huggingface_hub, "get_session", lambda: Unreachable())
    monkeypatch.setattr(harness, "_task_manager", lambda *args: pytest.fail("the built-in tasks were indexed"))
    with pytest.raises(UserError) as refused:
        run_harness(HarnessModel(str(tmp_path)), ["hellaswag"], device="cpu")
    assert str(refused.value).startswith("cannot reach the Hugging Face Hub at ")
    assert " to fetch the dataset of hellaswag (ConnectionError: [Errno -2] Name or service not known); " in \
        str(refused.value)
    assert str(tmp_path) not in str(refused.value)


def test_offline_a_hub_model_missing_from_the_cache_is_refused_at_once(tmp_path, monkeypatch):
    """Seen to catch: without the early check, the harness built its tasks and failed in the model's download."""
    import eval.harness as harness

    monkeypatch.setattr(harness, "_task_manager", lambda *args: pytest.fail("the tasks were built"))
    with pytest.raises(UserError) as refused:
        run_harness(HarnessModel("someone/not-cached-gpt2"), ["hellaswag_tiny"], include_path=TASKS, device="cpu")
    assert str(refused.value).startswith("cannot fetch the model someone/not-cached-gpt2 from the Hub: offline")


def test_unfinished_runs_are_exported_to_a_temporary_folder_that_goes_away(tmp_path):
    model = opinionated_gpt()
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000005"
    checkpoint.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(checkpoint / "model.safetensors"))
    (checkpoint / "gpt_config.json").write_text(json.dumps(asdict(model.config)))
    with resolve_model(str(checkpoint)) as weights:
        export = Path(weights.pretrained)
        assert (export / "config.json").is_file() and (export / "tokenizer.json").is_file()
        assert weights.run.path == tmp_path / "run" and weights.source == checkpoint
        tokens = torch.arange(33)[None]
        torch.testing.assert_close(GPT.from_pretrained(export)(tokens[:, :-1], tokens[:, 1:])[1],
                                   model(tokens[:, :-1], tokens[:, 1:])[1])
    assert not export.exists()


def test_a_mistyped_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match=r"no folder out/my_rnu \(though out/ exists\); check the path"):
        with resolve_model("out/my_rnu"):
            pass


@pytest.mark.slow  # loads the model in the harness: about 3 s
def test_an_ending_longer_than_the_context_is_one_line(tmp_path, at_repo_root):
    GPT(GPTConfig(block_size=4, n_layer=1, n_head=1, n_embd=8)).save_pretrained(tmp_path / "hf")
    with pytest.raises(UserError, match="longer than the model's context"):
        run_harness(HarnessModel(str(tmp_path / "hf")), ["hellaswag_tiny"], include_path=TASKS, device="cpu")


@pytest.mark.slow  # not among the local tasks, so the harness indexes its built-in ones: about 10 s
def test_unknown_task_is_one_line(tmp_path):
    with pytest.raises(UserError, match="unknown lm-eval task.*no_such_task"):
        run_harness(HarnessModel(str(tmp_path)), ["no_such_task"], include_path=TASKS, device="cpu")


def test_missing_lm_eval_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what a machine without the package sees on import
    with pytest.raises(UserError, match=r"pip install lm-eval"):
        require_lm_eval()
    with pytest.raises(UserError, match=r"pip install lm-eval"):
        main(["--model", "gpt2", "--tasks", "hellaswag"])


@pytest.mark.slow  # two harness runs on the tiny task
def test_an_hf_folder_without_tokenizer_files_is_scored_with_gpt2s(tmp_path, at_repo_root):
    """A plain `save_pretrained` of a model has no tokenizer files: the bridge lends it GPT-2's (as eval.hellaswag
    does) and scores it as the same folder with them.

    Seen to catch: the folder passed on as it is: "lm-eval stopped on an assertion"."""
    opinionated_gpt().save_pretrained(tmp_path / "with")
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "with", bare)
    for name in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    scores = []
    for folder in (tmp_path / "with", bare):
        with resolve_model(str(folder)) as weights:
            assert (weights.tokenizer is None) == (folder.name == "with")
            results = run_harness(weights, ["hellaswag_tiny"], include_path=TASKS, device="cpu")["results"]
        scores.append(results["hellaswag_tiny"]["acc_norm,none"])
    assert scores[0] == scores[1]
