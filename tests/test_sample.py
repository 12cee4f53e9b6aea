"""`python -m model.sample` against the Python API: greedy text equals `GPT.generate`, seeded samples equal
`GPT.generate` with a generator seeded `seed + j`, text streams as tokens are sampled, characters split
across tokens print whole, long prompts are cut on the left, and every bad input is one line, exit 2."""
from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT
from safetensors.torch import save_file

from common.errors import run_cli
from data.tokenizer import EOT_ID, get_tokenizer
from model import GPT, GPTConfig
from model.sample import SEPARATOR, main, stream_text

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[GPT, Path, Path]:
    """A random GPT with GPT-2's vocabulary, as an HF folder and as a finished run folder (final/)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    root = tmp_path_factory.mktemp("sample")
    model.save_pretrained(root / "hf")
    shutil.copytree(root / "hf", root / "run" / "final")
    return model, root / "hf", root / "run"


def api_continuation(model: GPT, prompt: str | list[int], n: int, seed: int | None = None, **sampling) -> str:
    """The text `GPT.generate` adds to `prompt`, decoded in one piece: the reference for the CLI."""
    enc = get_tokenizer()
    ids = enc.encode(prompt) if isinstance(prompt, str) else prompt
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    out = model.generate(torch.tensor([ids]), n, generator=generator, **sampling)
    return enc.decode(out[0, len(ids):].tolist())


def run_main(capsys, *argv: str, stdin: str = "") -> tuple[str, str]:
    main(list(argv), stdin=io.StringIO(stdin))
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.mark.parametrize("where", ["hf", "run"])
def test_greedy_prints_exactly_what_generate_gives(tiny, capsys, where):
    """`--temperature 0` prints exactly the prompt + `enc.decode` of `GPT.generate`'s new tokens, from an HF folder and
    a run folder, past `block_size`.

    Seen to catch: the first prompt token dropped before `generate_stream`."""
    model, hf, run = tiny
    prompt = "The meaning of life is"
    # 40 new tokens run past block_size=32: the sliding window is part of what must match.
    out, err = run_main(capsys, "--model", str(hf if where == "hf" else run), "--prompt", prompt,
                        "--temperature", "0", "--max_new_tokens", "40", "--device", "cpu")
    assert out == prompt + api_continuation(model, prompt, 40, temperature=0.0) + "\n"
    assert err == ""  # greedy: no seed note


def test_seeded_samples_are_generate_with_seed_plus_j(tiny, capsys):
    """Sample j is `GPT.generate` with a generator seeded `seed + j`; the same seed repeats; the random seed shown on
    stderr repeats the sample.

    Seen to catch: every sample seeded with `args.seed` (no `+ j`)."""
    model, hf, _ = tiny
    args = ["--model", str(hf), "--prompt", "Once upon a time", "--max_new_tokens", "12", "--top_k", "40",
            "--top_p", "0.9", "--temperature", "0.8", "--device", "cpu"]
    out, _ = run_main(capsys, *args, "--seed", "5", "--num_samples", "3")
    samples = out.split("\n" + SEPARATOR + "\n")
    expected = ["Once upon a time" + api_continuation(model, "Once upon a time", 12, seed=5 + j, temperature=0.8,
                                                      top_k=40, top_p=0.9) for j in range(3)]
    assert samples == expected[:2] + [expected[2] + "\n"]
    assert len(set(expected)) == 3  # three different samples
    assert run_main(capsys, *args, "--seed", "5", "--num_samples", "3")[0] == out  # same seed, same text
    assert run_main(capsys, *args, "--seed", "6")[0] == expected[1] + "\n"
    # Without --seed a random one is drawn and shown on stderr; passing it back repeats the sample.
    out, err = run_main(capsys, *args)
    seed = err.split("--seed ")[1].split()[0]
    assert run_main(capsys, *args, "--seed", seed)[0] == out


def test_generate_stream_is_generate_one_token_at_a_time(tiny):
    """`GPT.generate_stream` yields a token after one forward pass, and its tokens are `generate`'s for a seed.

    Seen to catch: the loop collecting all tokens and yielding them at the end."""
    model, _, _ = tiny
    prompt = torch.tensor([get_tokenizer().encode("Hello")])
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    stream = model.generate_stream(prompt, 30, top_k=20, generator=torch.Generator().manual_seed(1))
    first = next(stream)
    assert first.shape == (1, 1) and len(calls) == 1  # yielded after one forward pass, not after all 30
    tokens = torch.cat([prompt, first, *stream], dim=1)
    hook.remove()
    assert torch.equal(tokens, model.generate(prompt, 30, top_k=20, generator=torch.Generator().manual_seed(1)))


def scripted_model(prompt_len: int, targets: list[int]) -> GPT:
    """A GPT whose greedy continuation of any `prompt_len`-token prompt is `targets`: the blocks add nothing,
    token t's embedding is a basis vector e_t, and position p's is 10 * e_(the token to emit there), so
    after the last LayerNorm the largest logit is that token's."""
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=32, block_size=64)).eval()
    basis = {t: i for i, t in enumerate(dict.fromkeys(targets))}
    with torch.no_grad():
        for proj in (model.transformer.h[0].attn.c_proj, model.transformer.h[0].mlp.c_proj):
            proj.weight.zero_()
            proj.bias.zero_()
        model.transformer.wte.weight.zero_()
        model.transformer.wpe.weight.zero_()
        for t, i in basis.items():
            model.transformer.wte.weight[t, i] = 1.0
        for k, t in enumerate(targets):
            model.transformer.wpe.weight[prompt_len - 1 + k, basis[t]] = 10.0
    return model


@pytest.mark.slow
def test_characters_split_across_tokens_print_whole(tmp_path):
    """GPT-2 splits 日, 本 and 語 over two tokens each: the CLI must print each once it is complete, as
    valid UTF-8, not the replacement characters of decoding token by token. Through a real pipe: the
    prompt on standard input, the text on standard output, from a checkpoint folder.

    Seen to catch: decoding token by token (`enc.decode([token])`)."""
    enc = get_tokenizer()
    prompt, text = "Say:", "日本語 café"
    targets = enc.encode(text)
    assert any(b"\xe6" in enc.decode_single_token_bytes(t) for t in targets)  # really split
    model = scripted_model(len(enc.encode(prompt)), targets)
    pieces = list(stream_text(model, enc.encode(prompt), len(targets), temperature=0.0))
    assert pieces == ["日", "本", "語", " café"]
    checkpoint = tmp_path / "step_000001"
    checkpoint.mkdir()
    (checkpoint / "gpt_config.json").write_text(json.dumps(dataclasses.asdict(model.config)))
    save_file({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, checkpoint / "model.safetensors")
    proc = subprocess.run(
        [sys.executable, "-m", "model.sample", "--model", str(checkpoint), "--temperature", "0",
         "--max_new_tokens", str(len(targets))],
        input=(prompt + "\n").encode(), capture_output=True, cwd=REPO_ROOT, timeout=120,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode("utf-8") == prompt + text + "\n"  # strict decode: valid UTF-8


def test_long_prompt_is_cut_on_the_left_with_a_note(tiny, capsys):
    """A prompt longer than the context is cut on the left, with a note.

    Seen to catch: cut on the right (`ids[:block_size]`)."""
    model, hf, _ = tiny
    enc = get_tokenizer()
    prompt = " ".join(f"word{i}" for i in range(40))
    ids = enc.encode(prompt)
    assert len(ids) > 32
    out, err = run_main(capsys, "--model", str(hf), "--prompt", prompt, "--temperature", "0",
                        "--max_new_tokens", "5")
    assert out == prompt + api_continuation(model, ids[-32:], 5, temperature=0.0) + "\n"
    assert f"note: the prompt has {len(ids)} tokens, more than the model's context of 32: it is cut on the left " \
           "to its last 32 tokens" in err


def test_prompt_from_stdin_or_file_and_empty_prompt(tiny, capsys, tmp_path):
    """stdin and `--prompt_file` drop one final newline; an empty prompt starts from `<|endoftext|>`.

    Seen to catch: the newline kept; the `<|endoftext|>` start removed (a ValueError traceback)."""
    model, hf, _ = tiny
    base = ["--model", str(hf), "--temperature", "0", "--max_new_tokens", "6"]
    expected = "Hi there" + api_continuation(model, "Hi there", 6, temperature=0.0) + "\n"
    assert run_main(capsys, *base, stdin="Hi there\n")[0] == expected  # echo's final newline is dropped
    (tmp_path / "p.txt").write_text("Hi there\n", encoding="utf-8")
    assert run_main(capsys, *base, "--prompt_file", str(tmp_path / "p.txt"))[0] == expected
    out, err = run_main(capsys, *base, "--prompt", "")
    assert out == api_continuation(model, [EOT_ID], 6, temperature=0.0) + "\n"
    assert "note: empty prompt: generating unconditionally, from <|endoftext|>" in err


def test_interactive_loop_over_piped_stdin(tiny, capsys):
    """`--interactive` answers each non-blank line of piped stdin; Ctrl-C ends it quietly
    (`test_ctrl_c_ends_the_interactive_loop_quietly`).

    Seen to catch: blank lines not skipped; the KeyboardInterrupt handler removed."""
    model, hf, _ = tiny
    out, _ = run_main(capsys, "--model", str(hf), "--interactive", "--temperature", "0", "--max_new_tokens", "6",
                      stdin="first prompt\n\n  \nsecond\n")
    assert out == "".join(api_continuation(model, p, 6, temperature=0.0) + "\n" for p in ("first prompt", "second"))


def test_ctrl_c_ends_the_interactive_loop_quietly(tiny, capsys):
    class CtrlCAfterOneLine(io.StringIO):
        def readline(self, *args):
            if self.tell():
                raise KeyboardInterrupt
            return super().readline(*args)

    _, hf, _ = tiny
    try:
        main(["--model", str(hf), "--interactive", "--max_new_tokens", "3", "--seed", "0"],
             stdin=CtrlCAfterOneLine("a prompt\nnever read\n"))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the prompt loop")
    out = capsys.readouterr().out
    assert out.count("\n") == 2 and out.endswith("\n\n")  # one sample, then the loop ends on a fresh line


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: --model; see `python -m model.sample --help`"),
    (["--model", "M", "--max_new_token", "3"],
     "unknown argument(s) --max_new_token 3 (did you mean --max_new_tokens?)"),
    (["--model", "no/such/model!"], "is not an existing folder nor a valid Hub model id"),
    (["--temperature", "-0.5"], "--temperature -0.5: use a number >= 0 (0 = greedy"),
    (["--temperature", "nan"], "--temperature nan: use a number >= 0"),
    (["--top_k", "-1"], "--top_k -1: use a count >= 1, or 0 for no top-k cut"),
    (["--top_p", "0"], "--top_p 0.0: use a probability in (0, 1]"),
    (["--top_p", "1.5"], "--top_p 1.5: use a probability in (0, 1]"),
    (["--max_new_tokens", "-1"], "--max_new_tokens -1: use a count >= 0"),
    (["--num_samples", "0"], "--num_samples 0: use a count >= 1"),
    (["--seed", "-3"], "--seed -3: use an integer from 0 to"),
    (["--prompt", "a", "--prompt_file", "b"], "both --prompt and --prompt_file given; pass one of them"),
    (["--interactive", "--prompt", "a"], "--interactive reads its prompts from standard input"),
    (["--prompt_file", "MISSING"], "cannot read --prompt_file MISSING (No such file or directory); check the path"),
    (["--prompt_file", "DIR"], "cannot read --prompt_file DIR (Is a directory)"),
    (["--prompt_file", "LATIN1"], "--prompt_file LATIN1 is not UTF-8 text (invalid continuation byte at byte 1)"),
    (["--device", "tpu9"], "unknown --device 'tpu9'; use auto, cpu, cuda, cuda:1 or mps"),
    pytest.param(["--device", "cuda"], "--device cuda: no cuda device on this machine",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    (["--model", "SMALL_VOCAB", "--prompt", "Hello"],
     "the prompt has token id 15,496, but the model knows only 128 token ids"),
])
def test_bad_input_is_one_line_exit_2(tiny, capsys, tmp_path, argv, message):
    _, hf, _ = tiny
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1")[2:])
    names = {"MISSING": tmp_path / "missing.txt", "DIR": tmp_path, "LATIN1": tmp_path / "latin1.txt",
             "SMALL_VOCAB": tmp_path / "small"}
    if "SMALL_VOCAB" in argv:
        GPT(GPTConfig(vocab_size=128, **TINY)).save_pretrained(tmp_path / "small")
    if argv and "--model" not in argv:
        argv = ["--model", "M", *argv]
    argv = [str(names.get(a, a)) for a in argv]
    message = message.replace("MISSING", str(names["MISSING"])).replace("LATIN1", str(names["LATIN1"]))
    message = message.replace("DIR", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: main(argv, stdin=io.StringIO("")))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_help_shows_each_default_once(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "usage: python -m model.sample" in text and "(default: None)" not in text
    assert "--temperature TEMPERATURE softmax temperature; 0 = greedy (default: 1.0)" in text


def test_cli_writes_each_piece_as_soon_as_it_is_sampled(tiny, monkeypatch):
    """stdout gets (and flushes) text while tokens are still being sampled, not all at the end.

    Seen to catch: `flush=False` on each piece."""
    import model.sample as sample

    sampled, writes = [], []
    original = GPT.generate_stream

    def counted(self, *args, **kwargs):
        for token in original(self, *args, **kwargs):
            sampled.append(token)
            yield token

    class Terminal(io.StringIO):
        def flush(self):
            writes.append((len(sampled), self.getvalue()))

    monkeypatch.setattr(sample.GPT, "generate_stream", counted)
    monkeypatch.setattr(sys, "stdout", Terminal())
    main(["--model", str(tiny[1]), "--prompt", "Hi", "--max_new_tokens", "8", "--temperature", "0"])
    shown = [n for n, text in writes if text != "Hi"]  # flushes after the echoed prompt
    assert len(set(shown)) >= 4 and shown[0] < 8, writes
