"""Generate text from a GPT, streamed to the terminal token by token.

Usage: python -m model.sample --model gpt2 --prompt "Hello, I'm a language model,"
       echo "Once upon a time" | python -m model.sample --model out/run --num_samples 3
       python -m model.sample --model out/run --interactive

Invariants:
- The tokens are those of `GPT.generate_stream` (the same sampling code as `GPT.generate`): with
  `--temperature 0` the printed continuation is exactly `enc.decode(GPT.generate(...)[0, T:])`.
- Sample j of a prompt is drawn from its own generator seeded with `seed + j`: the same `--seed` gives
  the same samples, whatever `--num_samples` is, and sample j equals sample 0 of `--seed seed+j`.
- Only complete UTF-8 is printed: a character split across BPE tokens appears once its last byte is
  sampled (bytes still pending at the end are printed as U+FFFD, as `enc.decode` would).
- stdout holds the samples only (the prompt, then its continuation; only the continuation in
  `--interactive`, where the prompt was just typed); notes go to stderr.
"""
from __future__ import annotations

import codecs
import contextlib
import math
import os
import sys
from pathlib import Path
from typing import Iterator, Sequence, TextIO

import torch

from common.cli import CliParser
from common.errors import UserError, run_cli
from data.tokenizer import EOT_ID, EOT_TOKEN, N_VOCAB, get_tokenizer, require_known_ids
from model.gpt import GPT

SEPARATOR = "-" * 40  # a line of its own between the samples of one prompt
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed accepts up to 2**64 - 1; seed + j must fit


def stream_text(model: GPT, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> Iterator[str]:
    """Yield the continuation of `prompt` (token ids) as text, a piece per sampled token that completes
    UTF-8 (an empty piece is not yielded). The pieces joined equal `enc.decode` of the new tokens."""
    enc = get_tokenizer()
    device = next(model.parameters()).device
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    # errors="replace" like tiktoken's decode; an incremental decoder keeps a split character's first bytes.
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token in model.generate_stream(idx, max_new_tokens, temperature, top_k, top_p, generator=generator):
        piece = utf8.decode(enc.decode_single_token_bytes(token.item()))
        if piece:
            yield piece
    tail = utf8.decode(b"", final=True)
    if tail:
        yield tail


def encode_prompt(text: str, block_size: int, vocab_size: int) -> list[int]:
    """Token ids of `text` (`<|endoftext|>` is the special token), cut on the left to the model's context,
    with a note on stderr; an empty prompt starts from `<|endoftext|>`, as GPT-2 samples unconditionally."""
    ids = get_tokenizer().encode(text, allowed_special="all")
    if not ids:
        note(f"empty prompt: generating unconditionally, from {EOT_TOKEN}")
        ids = [EOT_ID]
    require_known_ids(max(ids), vocab_size, "the prompt", "the model")
    if len(ids) > block_size:
        note(f"the prompt has {len(ids)} tokens, more than the model's context of {block_size}: "
             f"it is cut on the left to its last {block_size} tokens")
        ids = ids[-block_size:]
    return ids


def note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


def pick_device(name: str) -> torch.device:
    """`--device`: `auto` is cuda, else mps, else cpu; a named device must exist here."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown --device {name!r}; use auto, cpu, cuda, cuda:1 or mps") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available.get(device.type, False):
        raise UserError(f"--device {name}: no {device.type} device on this machine; use --device auto or cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                        f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return device


def load_model(spec: str, device: torch.device) -> GPT:
    """`GPT.from_pretrained(spec)` (Hub id, HF folder, our checkpoint or run folder), in eval mode on `device`."""
    model = GPT.from_pretrained(spec)
    if model.config.vocab_size > N_VOCAB:
        raise UserError(f"{spec} has {model.config.vocab_size} token ids, more than GPT-2's tokenizer ({N_VOCAB}) "
                        "can print; use a model trained with GPT-2's tokenizer")
    return model.to(device).eval()


def check_settings(args) -> None:
    """The flags' values, before the model is loaded: a bad value costs no load time."""
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature {args.temperature}: use a number >= 0 (0 = greedy, 1 = the model's own "
                        "distribution)")
    if args.top_k < 0:
        raise UserError(f"--top_k {args.top_k}: use a count >= 1, or 0 for no top-k cut")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top_p {args.top_p}: use a probability in (0, 1]; 1 = no nucleus cut")
    if args.max_new_tokens < 0:
        raise UserError(f"--max_new_tokens {args.max_new_tokens}: use a count >= 0")
    if args.num_samples < 1:
        raise UserError(f"--num_samples {args.num_samples}: use a count >= 1")
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED - args.num_samples:
        raise UserError(f"--seed {args.seed}: use an integer from 0 to {MAX_SEED - args.num_samples}")
    if args.interactive and (args.prompt is not None or args.prompt_file is not None):
        raise UserError("--interactive reads its prompts from standard input, one per line; "
                        "drop --prompt/--prompt_file, or drop --interactive")
    if args.prompt is not None and args.prompt_file is not None:
        raise UserError("both --prompt and --prompt_file given; pass one of them")


def read_prompt(args, stdin: TextIO) -> str:
    """`--prompt`, else the text of `--prompt_file`, else all of standard input; one final newline of a
    file or of standard input is dropped (editors and `echo` add it)."""
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"--prompt_file {path} is not UTF-8 text ({err.reason} at byte {err.start}); "
                            "save it as UTF-8") from None
        except OSError as err:
            raise UserError(f"cannot read --prompt_file {path} ({err.strerror}); check the path") from None
    else:
        if stdin.isatty():
            note("reading the prompt from standard input; end it with Ctrl-D (or pass --prompt)")
        text = stdin.read()
    return text.removesuffix("\n").removesuffix("\r")


def interactive_prompts(stdin: TextIO) -> Iterator[str]:
    """One prompt per line of standard input, blank lines skipped, until end of input.
    On a terminal, `input` shows a `> ` prompt and offers line editing."""
    terminal = stdin.isatty() and sys.stdout.isatty()
    while True:
        try:
            line = input("> ") if terminal else stdin.readline()
        except EOFError:
            return
        if not terminal and not line:
            return
        line = line.rstrip("\r\n")
        if line.strip():
            yield line


def generator_for(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def main(argv: Sequence[str] | None = None, stdin: TextIO | None = None) -> None:
    parser = CliParser(prog="python -m model.sample", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="Hub id, HF GPT-2 folder, our checkpoint folder or run folder (its final/, "
                             "else its newest checkpoint)")
    parser.add_argument("--prompt", default=None,
                        help="text to continue; default: --prompt_file, else standard input; an empty "
                             "prompt starts from <|endoftext|>")
    parser.add_argument("--prompt_file", default=None, help="UTF-8 file holding the prompt (default: none)")
    parser.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate per sample")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k most likely tokens; 0 = all")
    parser.add_argument("--top_p", type=float, default=1.0,
                        help="sample among the most likely tokens holding this probability; 1 = all")
    parser.add_argument("--num_samples", type=int, default=1, help="samples per prompt")
    parser.add_argument("--seed", type=int, default=None,
                        help="sample j uses seed + j; default: a random seed, shown on stderr")
    parser.add_argument("--device", default="auto", help="auto (cuda, else mps, else cpu), cpu, cuda, cuda:1, mps")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                        help="auto: bf16 autocast on a CUDA GPU that supports it, fp32 elsewhere")
    parser.add_argument("--interactive", action="store_true",
                        help="a prompt loop: each line of standard input is a prompt; Ctrl-C or Ctrl-D ends it")
    args = parser.parse_args(argv)
    stdin = sys.stdin if stdin is None else stdin
    check_settings(args)
    prompt_text = None if args.interactive else read_prompt(args, stdin)  # before the model: fails fast
    device = pick_device(args.device)
    model = load_model(args.model, device)
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    context = model.config.block_size, model.config.vocab_size
    prompt_ids = None if args.interactive else encode_prompt(prompt_text, *context)
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
        if args.temperature > 0:
            note(f"seed {args.seed} (pass --seed {args.seed} to draw these samples again)")

    def samples(text: str, ids: list[int], echo: bool) -> None:
        """All samples of one prompt, each streamed to stdout piece by piece."""
        for j in range(args.num_samples):
            if j:
                print(SEPARATOR, flush=True)
            if echo:
                print(text, end="", flush=True)
            autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
            with autocast:
                for piece in stream_text(model, ids, args.max_new_tokens, temperature=args.temperature,
                                         top_k=args.top_k or None, top_p=args.top_p,
                                         generator=generator_for(device, args.seed + j)):
                    print(piece, end="", flush=True)
            print(flush=True)

    try:
        if not args.interactive:
            samples(prompt_text, prompt_ids, echo=True)
            return
        for line in interactive_prompts(stdin):
            samples(line, encode_prompt(line, *context), echo=False)
    except KeyboardInterrupt:
        if not args.interactive:
            raise
        print(flush=True)  # Ctrl-C ends the prompt loop quietly, on a fresh line
    except BrokenPipeError:
        # The reader left (`| head`): stop quietly, and keep Python from failing again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    run_cli(main)
