"""HellaSwag scorer: harness preprocessing, a hand-checkable model, batched vs one-at-a-time
scoring, exact totals for any world size, the accuracies of the evaluate metric on hand-made
scores, and bad input (including a missing `evaluate`)."""
from __future__ import annotations

import gzip
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import fake_ranks
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO_ROOT, free_port
from fake_ranks import CountingModel, run_ranks

import eval.hellaswag as hellaswag
from common.errors import UserError, run_cli
from data import get_tokenizer
from eval.hellaswag import (
    evaluate_hellaswag,
    item_loglikelihoods,
    load_items,
    preprocess,
    require_metric_packages,
)
from eval.hellaswag_data import SAMPLE_FILE, query_and_choices
from model import GPT, GPTConfig

FIXTURES = Path(__file__).parent / "fixtures" / "eval"

TINY = FIXTURES / "hellaswag_tiny.jsonl"
UNIFORM = FIXTURES / "hellaswag_uniform.jsonl"


def tiny_gpt(seed: int = 0, block_size: int = 64) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=block_size, n_layer=2, n_head=2, n_embd=32)).eval()


# ---------------------------------------------------------------- preprocessing (hand-written)

def test_preprocess_wikihow_markers():
    # strip happens first, so a removed leading marker leaves its space behind
    assert preprocess("  [header] How to dye your hair [title] Choose a color. [step] Pick one. ") == \
        " How to dye your hair. Choose a color. Pick one."
    assert preprocess("[substeps] Rinse it out.  Then dry.") == " Rinse it out. Then dry."
    assert preprocess("are done, [title] wash the dog.") == "are done,. wash the dog."
    # one pass of "  " -> " ": a run of three spaces keeps two
    assert preprocess("paint   the fence [step] twice.") == "paint  the fence twice."
    # non-greedy: two markers on a line are removed separately, text between them stays
    assert preprocess("a [step] b [step] c") == "a b c"


def test_query_follows_harness_format():
    items = load_items(TINY)
    query, choices = query_and_choices(items[2])
    # ctx_b.capitalize() lowercases the rest ("once YOU" -> "Once you")
    assert query == ("Personal Care and Style: How to dye your hair. Choose a color. "
                     "Pick a shade close to your natural color. Once you")
    assert choices == ["go darker, you can always dye it again.", " Rinse it out. Then dry.",
                       "are done,. wash the dog.", "paint  the fence twice."]
    # empty ctx_b: marker removed after strip leaves a trailing space (moved to the continuation)
    assert query_and_choices(items[3])[0] == \
        "Home and Garden: How to clean a grill. Heat the grill for fifteen minutes. "
    # items with only `ctx` (the offline approximate copy) use it as is
    assert query_and_choices(items[5])[0] == \
        "Baking cookies: A woman mixes flour and sugar in a bowl. she"
    assert [item["label"] for item in items] == [3, 3, 0, 1, 2, 1, 0]  # "1" -> 1


# ---------------------------------------------------------------- a hand-checkable model

def test_uniform_model_known_answers():
    """A GPT with a zero output layer predicts the uniform distribution: every token costs
    log(50257), so an ending's log-likelihood is -n_tokens * log(V). Endings " a", " b c",
    " d e f", " g h i j" have 1-4 tokens and 1, 3, 5, 7 characters (leading space excluded):
    acc picks ending 0 (fewest tokens); acc_norm picks ending 3 (fewest tokens per character;
    with the space counted all four would tie at 1/2 and ending 0 would win); acc_norm_tokens
    ties everywhere and picks ending 0."""
    model = tiny_gpt()
    torch.nn.init.zeros_(model.lm_head.weight)
    items = load_items(UNIFORM)  # labels 0, 3, 1, 0, 2
    lls = item_loglikelihoods(model, items, batch_size=2)
    expected = -np.array([1, 2, 3, 4]) * math.log(50257)
    np.testing.assert_allclose(lls, np.tile(expected, (5, 1)), rtol=1e-5)
    result = evaluate_hellaswag(model, items, batch_size=2)
    assert result == {"n": 5, "acc": 2 / 5, "acc_norm": 1 / 5, "acc_norm_tokens": 2 / 5}


# ---------------------------------------------------------------- batched vs one at a time

def one_item_scorer(model: GPT, items: list[dict]) -> np.ndarray:
    """Reference: one unpadded forward per ending, log-softmax, sum over the ending's tokens."""
    enc, block = get_tokenizer(), model.config.block_size
    out = np.zeros((len(items), 4))
    for i, item in enumerate(items):
        query, choices = query_and_choices(item)
        ctx_tokens = enc.encode(query.rstrip())  # trailing spaces belong to the continuation
        for j, choice in enumerate(choices):
            cont_tokens = enc.encode(query + " " + choice)[len(ctx_tokens):]
            seq = (ctx_tokens + cont_tokens)[-(block + 1):]
            n = min(len(cont_tokens), len(seq) - 1)
            with torch.no_grad():
                logits, _ = model(torch.tensor([seq[:-1]]), all_logits=True)
            logp = F.log_softmax(logits[0].double(), dim=-1)
            targets = torch.tensor(seq[1:])
            out[i, j] = logp[torch.arange(len(seq) - 1), targets][-n:].sum().item()
    return out


def test_batched_matches_one_item_scorer():
    model = tiny_gpt(seed=1, block_size=128)
    items = load_items(TINY)
    ref = one_item_scorer(model, items)
    got = item_loglikelihoods(model, items, batch_size=3)  # 7 items: a partial last batch
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    assert (got.argmax(1) == ref.argmax(1)).all()
    labels = np.array([it["label"] for it in items])
    chars = np.array([[len(c) for c in query_and_choices(it)[1]] for it in items])
    result = evaluate_hellaswag(model, items, batch_size=3)
    assert result["n"] == 7
    assert result["acc"] == pytest.approx(np.mean(ref.argmax(1) == labels))
    assert result["acc_norm"] == pytest.approx(np.mean((ref / chars).argmax(1) == labels))


def test_long_items_cut_on_the_left_like_the_harness():
    model = tiny_gpt(seed=1, block_size=24)  # shorter than every item: contexts are cut
    items = load_items(TINY)[1:4]
    np.testing.assert_allclose(item_loglikelihoods(model, items, batch_size=2),
                               one_item_scorer(model, items), rtol=1e-5, atol=1e-4)


def test_trailing_context_space_moves_to_continuation():
    """Item 3's query ends with a space: like the harness, the context is encoded without it and
    the space is scored as part of the continuation."""
    from eval.hellaswag import encode_items

    enc = get_tokenizer()
    encoded = encode_items(load_items(TINY)[3:4], enc, None)[0]
    ctx = enc.encode("Home and Garden: How to clean a grill. Heat the grill for fifteen minutes.")
    for row, n in zip(encoded.rows, encoded.n_cont):
        assert row[:len(ctx)] == ctx and len(row) - n == len(ctx)
    assert enc.decode(encoded.rows[1][-encoded.n_cont[1]:]) == "  Scrub the grates with a wire brush."


# ---------------------------------------------------------------- exact totals across ranks

@pytest.fixture(scope="module")
def single_process():
    model = tiny_gpt(seed=2, block_size=128)
    return model, evaluate_hellaswag(model, load_items(TINY), batch_size=4)


@pytest.mark.parametrize("world,batch_size", [(3, 2), (8, 1)])  # 8 ranks > 7 items: idle ranks
def test_totals_exact_for_any_world_size(single_process, world, batch_size):
    model, single = single_process
    items = load_items(TINY)  # 7 items: divides by neither world size
    results, models = run_ranks(
        lambda m, acc: evaluate_hellaswag(m, items, batch_size=batch_size, accelerator=acc),
        model, world)
    assert all(r == single for r in results)  # same totals on every rank
    assert sum(m.rows for m in models) == 4 * len(items)  # every ending scored exactly once
    assert len({m.calls for m in models}) == 1  # same number of forward passes on every rank
    assert models[0].calls == math.ceil(math.ceil(7 / world) / batch_size)


@pytest.mark.parametrize("world", [1, 3, 8])
def test_metric_gets_every_item_once_in_order_on_the_main_process(single_process, monkeypatch, world):
    """The accuracies are computed once, on rank 0, from the single-process records in item order
    (the accuracies alone would not show a shuffle: labels and scores would move together).

    Seen to catch: no reordering of the gathered records; every rank computing the metric."""
    model, _ = single_process
    items = load_items(TINY)
    calls, real = [], hellaswag._accuracies

    def spy(lls, meta):
        calls.append((fake_ranks._current.accelerator.process_index, lls.copy(), meta.copy()))
        return real(lls, meta)

    monkeypatch.setattr(hellaswag, "_accuracies", spy)
    run_ranks(lambda m, acc: evaluate_hellaswag(m, items, batch_size=2, accelerator=acc), model, world)
    assert [rank for rank, _, _ in calls] == [0]
    _, lls, meta = calls[0]
    np.testing.assert_allclose(lls, item_loglikelihoods(model, items, batch_size=2), rtol=1e-5)
    encoded = hellaswag.encode_items(items, get_tokenizer(), model.config.block_size)
    assert meta.tolist() == [[e.label, *e.choice_chars, *e.n_cont] for e in encoded]
    assert meta[:, 0].tolist() == [3, 3, 0, 1, 2, 1, 0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cli_two_processes_match_one(tmp_path):
    """The CLI on a saved tiny model: `accelerate launch --config_file accelerate_configs/cpu_2proc.yaml` with 2
    real gloo ranks over 7 items gives the totals that one process computes, printed and written once.

    Under `accelerate_configs/cpu_2proc.yaml` as shipped (no `ACCELERATE_USE_CPU`): one gloo group, `world_size: 2`;
    `test_eval_val_loss.py::test_cli_two_processes_match_one` for eval.val_loss.

    Seen to catch: `cli_accelerator` back to `Accelerator(cpu=cpu)`: both launches end in the backstop's one line (exit
    1 through the launcher); with the backstop off too, the two copies of the issue."""
    tiny_gpt(seed=3, block_size=128).save_pretrained(tmp_path / "tiny")
    one = evaluate_hellaswag(GPT.from_pretrained(tmp_path / "tiny"), load_items(TINY), batch_size=3)
    args = ["-m", "eval.hellaswag", "--model", str(tmp_path / "tiny"), "--data", str(TINY),
            "--batch_size", "2"]
    root = Path(__file__).resolve().parents[1]
    # The README's CPU config as shipped, no ACCELERATE_USE_CPU: the command groups its ranks itself (issue 55: two
    # independent copies, each printing, each writing --output with world size 1).
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(root / "accelerate_configs" / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]
    two = subprocess.run([*launch, *args, "--output", str(tmp_path / "two.json")], cwd=root,
                         env={k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"},
                         capture_output=True, text=True)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("HellaSwag  n=7") == 1  # only the main process prints
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world_size"] == 2
    assert {key: two[key] for key in one} == one


class FakeAccelerator:
    """Stands in for accelerate's Accelerator: records what it was told, reports `joined` processes as its group."""

    joined = 1
    told: list[bool] = []

    def __init__(self, cpu: bool) -> None:
        FakeAccelerator.told.append(cpu)
        self.num_processes = FakeAccelerator.joined

    def wait_for_everyone(self) -> None:
        pass

    def end_training(self) -> None:
        pass


@pytest.mark.parametrize("cuda", [False, True])
def test_a_cli_launched_on_several_processes_groups_them_or_refuses_in_one_line(monkeypatch, cuda):
    """Under `accelerate launch` of several processes the evaluations' CLIs form one group, on the CPU over gloo where
    the machine has no CUDA (accelerate's launcher never passes cpu_2proc.yaml's use_cpu: each rank came up alone,
    evaluated everything, printed it and wrote the same --output, recording world size 1); ranks that still come up
    alone are one line naming the plain command, printed by rank 0.

    Seen to catch: `cli_accelerator` back to `Accelerator(cpu=cpu)`: `[False, False] != [False, True]`."""
    import accelerate
    import torch

    from eval.common import cli_accelerator

    monkeypatch.setattr(accelerate, "Accelerator", FakeAccelerator)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(FakeAccelerator, "told", [])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with cli_accelerator(cpu=False, command="python -m eval.hellaswag") as one:
        assert one.num_processes == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # what the launch sets beside it: no leftover (common.launch)
    monkeypatch.setattr(FakeAccelerator, "joined", 2)
    with cli_accelerator(cpu=False, command="python -m eval.hellaswag"):
        pass
    assert FakeAccelerator.told == [False, not cuda]  # a single process as it asked; two grouped on the CPU
    monkeypatch.setattr(FakeAccelerator, "joined", 1)
    with pytest.raises(UserError, match=r"^this launch started 2 processes but accelerate brought up 1 as a group, "
                                        r"so each would evaluate everything alone and write the same output; run "
                                        r"`python -m eval.hellaswag` with the same flags as one process, without "
                                        r"accelerate launch$") as err:
        with cli_accelerator(cpu=False, command="python -m eval.hellaswag"):
            raise AssertionError("the body ran")
    assert err.value.on_every_rank


def test_cli_bad_input_exits_2(tmp_path, capsys):
    from eval.hellaswag import main

    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: main(["--model", "gpt2", "--data", str(tmp_path / "missing.jsonl")]))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: HellaSwag file {tmp_path / 'missing.jsonl'} does not exist")


def test_training_mode_restored():
    model = tiny_gpt()
    model.train()
    evaluate_hellaswag(model, load_items(UNIFORM), batch_size=8)
    assert model.training


# ---------------------------------------------------------------- input handling

def test_jsonl_gz_and_limit(tmp_path):
    path = tmp_path / "items.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(TINY.read_text())
    items = load_items(path, limit=3)
    assert [it["ind"] for it in items] == [0, 1, 2]


@pytest.mark.parametrize("change,message", [
    (lambda it: it.pop("endings"), "missing field(s) endings"),
    (lambda it: (it.pop("ctx_a"), it.pop("ctx")), "ctx (or ctx_a and ctx_b)"),
    (lambda it: it.update(label=4), "label 4 is not an ending index"),
    (lambda it: it.update(label=""), "label '' is not an ending index"),
    (lambda it: it.update(endings=["a", "b", "c"]), "list of 4 strings"),
])
def test_bad_items_raise_user_error(tmp_path, change, message):
    item = json.loads(TINY.read_text().splitlines()[0])
    change(item)
    path = tmp_path / "bad.jsonl"
    path.write_text(TINY.read_text() + json.dumps(item) + "\n")
    with pytest.raises(UserError, match=r"item 7: .*" + message.replace("(", r"\(").replace(")", r"\)")):
        load_items(path)


def test_hub_copy_offline_gives_user_error():
    pytest.importorskip("datasets")
    with pytest.raises(UserError, match=r"cannot load Rowan/hellaswag from the Hub: offline .*--data"):
        load_items(None)  # conftest keeps the Hub offline


def test_bad_files_raise_user_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError, match="holds no items"):
        load_items(empty)
    with pytest.raises(UserError, match="does not exist"):
        load_items(tmp_path / "missing.jsonl")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"activity_label": \n')
    with pytest.raises(UserError, match=r"broken.jsonl:1: not valid JSON"):
        load_items(broken)
    with pytest.raises(UserError, match="^--limit must be at least 1, got 0; leave it out"):
        load_items(TINY, limit=0)  # the flag named as the user spells it (issue 44: "limit" without its --)
    with pytest.raises(UserError, match="^--hellaswag_limit must be at least 1"):
        load_items(TINY, limit=0, limit_flag="--hellaswag_limit")


def test_a_bad_json_line_is_named_in_full(tmp_path):
    """The file, the line, what is wrong and where in the line. Seen to catch: the message built from `err.msg`
    alone, which json cuts before its position ("Invalid control character at")."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(TINY.read_text(encoding="utf-8").splitlines()[0] + "\n" + '{"ctx": "a\tb"}\n', encoding="utf-8")
    with pytest.raises(UserError) as refused:
        load_items(bad)
    assert str(refused.value) == (f"{bad}:2: not valid JSON (Invalid control character at column 11); the file must "
                                  "hold one JSON object per line")


# ---------------------------------------------------------------- the accuracies (evaluate metric)

# Ending scores for which the three accuracies pick different endings, worked out by hand:
#   A: lls [-4, -6, -9, -8], chars [2, 6, 9, 16], tokens [1, 3, 3, 2]
#      acc: -4 is highest -> 0; acc_norm: [-2, -1, -1, -0.5] -> 3; acc_norm_tokens: [-4, -2, -3, -4] -> 1
#   T (ties): lls [-5, -3, -3, -7], chars [5, 3, 3, 7], tokens [1, 1, 1, 1]
#      acc: -3 twice -> 1 (the first); acc_norm: all -1 -> 0; acc_norm_tokens: as acc -> 1
A = ([-4.0, -6.0, -9.0, -8.0], [2, 6, 9, 16], [1, 3, 3, 2])
T = ([-5.0, -3.0, -3.0, -7.0], [5, 3, 3, 7], [1, 1, 1, 1])
HAND = [(A, 0), (A, 3), (A, 3), (A, 1), (A, 1), (A, 1), (T, 1), (T, 0)]


def test_accuracies_by_hand_ties_go_to_the_first_ending():
    """acc: items 0 and 6 (2/8); acc_norm: items 1, 2 and 7 (3/8); acc_norm_tokens: items 3-6 (4/8).
    Ties going to a later ending would lose item 6 for acc and acc_norm_tokens and item 7 for acc_norm.

    acc, acc_norm (characters) and acc_norm_tokens as the harness and build-nanogpt define them; ties go to the first
    ending.

    Seen to catch: ties going to the last ending; character and token lengths swapped."""
    lls = np.array([scores for (scores, _, _), _ in HAND], dtype=np.float64)
    meta = np.array([[label, *chars, *tokens] for (_, chars, tokens), label in HAND], dtype=np.int64)
    assert hellaswag._accuracies(lls, meta) == {"n": 8, "acc": 2 / 8, "acc_norm": 3 / 8,
                                                 "acc_norm_tokens": 4 / 8}


def test_missing_evaluate_is_a_one_line_user_error_before_scoring(monkeypatch):
    """HellaSwag without `evaluate` is one line, before any forward pass.

    Seen to catch: the early package check removed; a two-line message."""
    monkeypatch.setitem(sys.modules, "evaluate", None)  # `import evaluate` now raises ImportError
    with pytest.raises(UserError) as info:
        require_metric_packages()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("HellaSwag accuracies need the `evaluate` package")
    assert message.endswith("; pip install evaluate")
    model = CountingModel(tiny_gpt())
    with pytest.raises(UserError) as info:
        evaluate_hellaswag(model, load_items(UNIFORM), batch_size=2)
    assert str(info.value) == message
    assert model.calls == 0  # failed before the forward passes, not after


# ---- damaged HellaSwag files (faults and bad input) --------------------------------------------------------

@pytest.mark.parametrize("damage", [lambda b: b[: len(b) // 2], lambda b: b"<html>not gzip</html>"],
                         ids=["truncated", "not-gzip"])
def test_a_damaged_jsonl_gz_is_one_line_naming_the_file(tmp_path, damage):
    src = Path(__file__).parent / "fixtures" / "eval" / "hellaswag_tiny.jsonl"
    whole = tmp_path / "whole.jsonl.gz"
    whole.write_bytes(gzip.compress(src.read_bytes() * 20))
    assert len(load_items(whole)) > 0
    path = tmp_path / "hellaswag_val.jsonl.gz"
    path.write_bytes(damage(whole.read_bytes()))
    with pytest.raises(UserError) as err:
        load_items(path)
    message = str(err.value)
    assert message.startswith(f"{path} is a truncated or damaged gzip file (") and "\n" not in message
    assert message.endswith("download it again, or pass the uncompressed .jsonl")



def suggested_hellaswag(run: Path, hellaswag_data: str | None) -> list[str]:
    """The arguments of the eval.hellaswag command that a run's `next:` line suggests."""
    from training.evaluations.hellaswag import HellaSwagFlags
    from training.evaluations.runner import next_steps

    line = next_steps(run, (6, {"val_loss": 5.0}), {"hellaswag": HellaSwagFlags(hellaswag_data=hellaswag_data)})
    (command,) = [part for part in line.split(", python -m ") if part.startswith("eval.hellaswag ")]
    return shlex.split(command.partition(" (")[0])[1:]  # the command, without its note in parentheses


@pytest.mark.parametrize("own", [False, True], ids=["the shipped items", "the run's --hellaswag_data"])
def test_the_end_of_run_hellaswag_command_parses_and_reads_its_items_offline(tmp_path, monkeypatch, own):
    """The run's `next:` line suggests eval.hellaswag on a local file (issue 44: without `--data` it read the Hub,
    which offline failed after 32 s): its arguments, from the repository root where train.py ran, parse and name
    items that load offline (HF_HUB_OFFLINE=1, conftest: reading the Hub would be a refusal).

    Run whole on a tiny model it scores the 7 shipped items
    (`test_the_end_of_run_hellaswag_command_runs_offline_as_written`).

    Seen to catch: the suggestion back to `--model <run>` without `--data`: both fail, "cannot load Rowan/hellaswag from
    the Hub: offline"."""
    monkeypatch.chdir(REPO_ROOT)
    own_file = REPO_ROOT / "tests" / "fixtures" / "eval" / "hellaswag_uniform.jsonl"
    args = hellaswag.parser().parse_args(suggested_hellaswag(tmp_path / "run", str(own_file) if own else None))
    assert args.model == str(tmp_path / "run")
    assert len(load_items(args.data, args.limit)) == len((own_file if own else SAMPLE_FILE).read_text().splitlines())


@pytest.mark.slow  # eval.hellaswag's first run in a process imports what scoring needs: about 10 s on 2 cores
def test_the_end_of_run_hellaswag_command_runs_offline_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    tiny_gpt().save_pretrained(tmp_path / "run")
    result = hellaswag.main(suggested_hellaswag(tmp_path / "run", None))
    assert result["n"] == len(SAMPLE_FILE.read_text().splitlines())
