"""Prompt/completion .jsonl data: detection, the targets mask, padding without cuts, one-line errors, exact
resume, masked validation loss, and the step's gradient = that of the mean over all target tokens of the
global batch (2 processes x 2 micro-steps == 1 x 4 == one big batch).

References are independent: tiktoken's ids for the mask, a per-example loop over unpadded sequences for the
validation loss, one big batch's plain `loss.backward()` for the gradients, an uninterrupted run for resume.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO_ROOT, free_port
from safetensors.torch import load_file

from common.errors import UserError
from data.pairs import PairsLoader, is_pairs_dataset, read_pairs, split_pairs
from data.settings import DataConfig
from data.source import DataSource, open_source
from data.strided import StridedLoader
from data.tokenizer import EOT_ID, IGNORE, get_tokenizer


def source(dataset: str, **settings) -> DataSource:
    """`dataset` parsed as train.py parses `--dataset` (other settings at their defaults unless given)."""
    return open_source(DataConfig(dataset=dataset, **settings))


WORDS = "the cat sat on a mat and then it ran to see what was there under an old red tree".split()


def write_pairs(path: Path, n: int = 40, seed: int = 0) -> Path:
    """n examples of very different lengths: prompts of 0-12 words (after a tag), completions of 1-15."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            prompt = f"Q{i}:" + "".join(" " + rng.choice(WORDS) for _ in range(rng.randint(0, 12)))
            completion = "".join(" " + rng.choice(WORDS) for _ in range(rng.randint(1, 15)))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl")


def rows_of(loader, calls: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for _ in range(calls):
        x, y = loader.next_batch()
        out += list(zip(x.tolist(), y.tolist()))
    return out


# ---- detection and the mask ------------------------------------------------------------------------------

def test_detection_by_the_first_record(tmp_path, pairs):
    fields = dict(text_column="text", prompt_field="prompt", completion_field="completion")
    assert is_pairs_dataset(str(pairs), **fields)
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "a longer document, of some tokens", "prompt": "metadata"}) + "\n")
    assert not is_pairs_dataset(str(text), **fields)  # a text column and only one of the fields: text
    loader = source(str(text)).train_loader(block_size=2, micro_batch_size=1, rank=0, world_size=1, seed=0)
    assert isinstance(loader, StridedLoader) and not loader.masked_targets
    renamed = tmp_path / "qa.jsonl"
    renamed.write_text(json.dumps({"q": "2+2=", "a": " 4"}) + "\n" + json.dumps({"q": "1+1=", "a": " 2"}) + "\n")
    assert is_pairs_dataset(str(renamed), **{**fields, "prompt_field": "q", "completion_field": "a"})


def test_targets_are_the_completion_and_its_eot_only(tmp_path):
    """Targets are the completion and its end-of-text only (against tiktoken ids).

    Seen to catch: no prompt mask; one token too many masked; padding with 0."""
    path = tmp_path / "two.jsonl"
    path.write_text(json.dumps({"prompt": "Translate: cat", "completion": " chat"}) + "\n"
                    + json.dumps({"prompt": "", "completion": " hello world"}) + "\n")
    enc = get_tokenizer()
    loader = PairsLoader(read_pairs(str(path)), block_size=8, micro_batch_size=2, rank=0, world_size=1, seed=0)
    got = {tuple(x): y for x, y in rows_of(loader, 1)}
    for prompt, completion in (("Translate: cat", " chat"), ("", " hello world")):
        p, c = enc.encode(prompt), enc.encode(completion)
        tokens = p + c + [EOT_ID]
        n = len(tokens) - 1
        x = tokens[:-1] + [EOT_ID] * (8 - n)  # right padding
        # Targets: each completion token that has a context before it, and the EOT; nothing else.
        y = [IGNORE] * max(len(p) - 1, 0) + (c if p else c[1:]) + [EOT_ID] + [IGNORE] * (8 - n)
        assert got[tuple(x)] == y


def test_an_epoch_gives_every_example_whole_once_and_ranks_disjoint(pairs):
    """An epoch gives every example whole, once; ranks read disjoint rows.

    Seen to catch: padding with 0; every rank reading the same rows."""
    train, _ = split_pairs(read_pairs(str(pairs)))
    assert len(train) == 36  # 40 examples, the last 4 held out
    seen = []
    for rank in (0, 1):
        loader = source(str(pairs)).train_loader(block_size=48, micro_batch_size=3, rank=rank, world_size=2, seed=5)
        assert loader.masked_targets
        # 6 calls x 2 ranks x 3 rows = one epoch of 36 examples; an example is its x up to the padding.
        for x, y in rows_of(loader, 6):
            n = max(i for i, t in enumerate(y) if t != IGNORE) + 1  # the last target is the example's EOT
            assert y[n - 1] == EOT_ID and all(t == EOT_ID for t in x[n:]) and all(t == IGNORE for t in y[n:])
            seen.append(tuple(x[:n]) + (y[n - 1],))
    assert sorted(seen) == sorted(tuple(t.tolist()) for t in train.tokens)


def test_an_example_too_long_is_never_cut(pairs):
    """An example too long is never cut: one line at start.

    Seen to catch: the check removed."""
    lengths = [len(t) for t in read_pairs(str(pairs)).tokens]
    block = sorted(lengths)[-3] - 1  # the two longest do not fit (unless tied with the third)
    too_long = sum(n > block + 1 for n in lengths)
    first = next(i for i, n in enumerate(lengths) if n > block + 1) + 1
    with pytest.raises(UserError, match=rf"^{too_long} of 40 examples in .* are longer than block_size \+ 1 = "
                                        rf"{block + 1} tokens \(the first at .*pairs.jsonl:{first}, the longest "
                                        rf"{max(lengths)} tokens\)"):
        source(str(pairs)).train_loader(block_size=block, micro_batch_size=1, rank=0, world_size=1, seed=0)


@pytest.mark.parametrize("lines, message", [
    ([{"prompt": "a", "completion": " b"}, {"prompt": "c"}], r"two.jsonl:2 has no 'completion' field"),
    ([{"prompt": "a", "completion": " b"}, {"prompt": "c", "completion": ""}],
     r"two.jsonl:2 has an empty completion \(no completion tokens"),
    ([{"prompt": "a", "completion": " b"}, {"prompt": 3, "completion": " d"}],
     r"two.jsonl:2 has a non-string \(int\) 'prompt' field"),
])
def test_bad_lines_name_file_and_line(tmp_path, lines, message):
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(UserError, match=message):
        source(str(path)).train_loader(block_size=8, micro_batch_size=1, rank=0, world_size=1, seed=0)


def test_bad_line_through_train_py_is_one_line(monkeypatch, capsys, tmp_path):
    from conftest import run_in_process

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": " b"}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    err = run_in_process(monkeypatch, capsys, ["--dataset", str(path), "--out_dir", str(tmp_path / "r")])
    assert f"{path}:2 has no 'completion' field" in err
    assert not (tmp_path / "r").exists()


def test_resume_continues_exactly_with_another_world_size(pairs):
    one = source(str(pairs)).train_loader(block_size=48, micro_batch_size=4, rank=0, world_size=1, seed=1)
    expected = rows_of(one, 20)  # 80 rows: two epochs and a bit, so the order of a new epoch is checked too
    first = source(str(pairs)).train_loader(block_size=48, micro_batch_size=4, rank=0, world_size=1, seed=1)
    got = rows_of(first, 7)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = [source(str(pairs)).train_loader(block_size=48, micro_batch_size=2, rank=r, world_size=2, seed=1)
               for r in (0, 1)]
    for loader in resumed:
        loader.load_state_dict(state)
    for _ in range(13):
        got += rows_of(resumed[0], 1) + rows_of(resumed[1], 1)
    assert got == expected


# ---- validation loss -------------------------------------------------------------------------------------

def test_masked_val_loss_equals_a_per_example_reference(pairs):
    """Held-out pairs are scored with the training mask.

    Seen to catch: the mask broken; padding counted."""
    from pairs_grads import tiny_gpt

    from eval.val_loss import evaluate_loss

    val = source(str(pairs), val_tokens=10_000).val_set(block_size=48)
    assert len(val) == 4 and val.where == split_pairs(read_pairs(str(pairs)))[1].where
    model = tiny_gpt().eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens, n_prompt in zip(val.tokens, val.n_prompt):
            seq = torch.tensor(tokens.astype("int64"))
            logits, _ = model(seq[None, :-1], all_logits=True)  # unpadded, one example at a time
            start = max(n_prompt - 1, 0)  # the first position whose target is a completion token
            total += F.cross_entropy(logits[0, start:], seq[1 + start:], reduction="sum").item()
            count += len(seq) - 1 - start
    assert count == val.n_targets()
    got = evaluate_loss(model, val, block_size=48, batch_size=3)  # 2 batches, one with a padding row
    assert got == pytest.approx(total / count, rel=1e-5)
    assert source(str(pairs), val_tokens=len(val.tokens[0])).val_set(block_size=48).where == val.where[:1]


# ---- the step's gradient ---------------------------------------------------------------------------------

def big_batch_gradient(pairs: Path) -> tuple[dict[str, torch.Tensor], float]:
    """The reference: the first step's 8 examples as one batch, the mean loss over their targets, backward;
    returns the gradients and that loss."""
    from pairs_grads import TINY, tiny_gpt

    x, y = source(str(pairs)).train_loader(block_size=TINY.block_size, micro_batch_size=8, rank=0, world_size=1,
                                           seed=0).next_batch()
    model = tiny_gpt()
    loss = model(x, y)[1]
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}, loss.item()


def accumulated_gradient(pairs: Path, out: Path) -> tuple[dict[str, torch.Tensor], float]:
    """One process, 4 micro-batches of 2, through train_step (in this process); and the step's loss."""
    import pairs_grads

    loss = pairs_grads.main(str(pairs), str(out), micro_batch=2, grad_accum=4)
    return load_file(out), loss


@pytest.mark.slow
def test_two_processes_one_process_and_one_big_batch_give_the_same_gradient(pairs, tmp_path):
    """The step's gradient is that of the mean over all target tokens of the global batch: 2 processes x 2 micro-steps =
    1 x 4 = one big batch (5.8e-8).

    Seen to catch: the mean of micro-batch means (1 x 4 fails); the scale without world_size (2 x 2 fails)."""
    out = tmp_path / "ddp.safetensors"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO_ROOT / "accelerate_configs" / "cpu_2proc.yaml"), "--num_processes", "2",
           "--main_process_port", str(free_port()), str(REPO_ROOT / "tests" / "pairs_grads.py"), str(pairs),
           str(out), "2", "2"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = load_file(out)
    single, single_loss = accumulated_gradient(pairs, tmp_path / "single.safetensors")
    big, big_loss = big_batch_gradient(pairs)
    assert single_loss == pytest.approx(big_loss, rel=1e-6)  # the loss train.py logs is the same mean
    assert ddp.keys() == single.keys() == big.keys()
    # Gradients, not weights: no optimizer has amplified their rounding (tests/bounds.py), so every element holds the
    # plain bound of a sum taken in another order, a few fp32 spacings of its terms (seen 5.8e-8); a mean of
    # micro-batch means instead of the mean over all target tokens is off by the ratio of their token counts.
    for name in big:
        assert big[name].abs().max() > 0, name
        torch.testing.assert_close(single[name], big[name], atol=1e-6, rtol=0, msg=f"1 x 4: {name}")
        torch.testing.assert_close(ddp[name], big[name], atol=1e-6, rtol=0, msg=f"2 x 2: {name}")


# ---- train.py end to end -----------------------------------------------------------------------------------

RUN_ARGS = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "48", "--val_tokens", "256",
            "--eval_batch_size", "4", "--sample_tokens", "4", "--lr", "3e-3", "--warmup_steps", "2", "--max_steps", "4",
            "--micro_batch_size", "2", "--total_batch_size", "192", "--save_every", "2", "--eval_every", "4",
            "--dropout", "0.1"]


@pytest.mark.slow
def test_train_py_on_pairs_resumes_its_own_checkpoint_bit_exact(pairs, tmp_path):
    """A run on pairs resumed from its own checkpoint is bit-exact; a resume with another world size continues the same
    examples (`test_resume_continues_exactly_with_another_world_size`).

    Seen to catch: a state_dict that saves cursor 0."""
    from conftest import assert_same_weights, launch, read_metrics, resume_copy

    args = RUN_ARGS + ["--dataset", str(pairs)]
    reference, out = tmp_path / "ref", tmp_path / "run"
    launch(args + ["--out_dir", str(reference)])
    launch(args + resume_copy(reference, 2, out))
    assert_same_weights(reference, out)
    last, expected = read_metrics(out)[-1], read_metrics(reference)[-1]
    assert expected["step"] == 4 and "val_loss" in expected
    assert {k: last[k] for k in ("step", "loss", "grad_norm", "val_loss")} == \
        {k: expected[k] for k in ("step", "loss", "grad_norm", "val_loss")}
