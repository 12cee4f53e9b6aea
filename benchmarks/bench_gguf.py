"""llama.cpp's converter on our export: f32, f16 and q8_0 GGUF files, read back and compared with the export.

    python -m benchmarks.bench_gguf [--export DIR] [--types f32,f16,q8_0] [--json results.json]

llama.cpp's `convert_hf_to_gguf.py` is not on PyPI by itself. It ships in the llama-cpp-python sdist
(vendor/llama.cpp, beside its `conversion/` package and its own copy of gguf-py). `converter()` fetches that sdist
once with pip, keeps those three parts in common/cache_dir.py's folder, and runs the script with this environment's
torch, transformers and numpy: all it imports for a GPT-2. The files are read back with the `gguf` package (the dev
extra). Without --export, a random 2-layer GPT with 128 positions is exported first.

Per type it prints the seconds the conversion took, the file's size, the context length and token count the file
records, and the largest difference between each weight and the export's, relative to that tensor's largest value.
f32 must be exact. f16 rounds to 11 significant bits: at most 2^-11 of a value. q8_0 stores blocks of 32 values
as int8 times one scale (the block's largest magnitude / 127, itself stored as f16): at most half a step, 1/254 of
the block's largest, plus the scale's own rounding, 2^-11 of it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common.cache_dir import cache_dir
from model import GPT, GPTConfig

SDIST = "llama-cpp-python==0.3.36"  # its vendor/llama.cpp holds convert_hf_to_gguf.py and gguf-py 0.19.0
CACHE = cache_dir() / SDIST.replace("==", "-")
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")  # what the converter needs of the llama.cpp tree
# GGUF's tensor names for GPT-2 (llama.cpp's gguf-py, MODEL_ARCH.GPT2) -> ours. Its matrices are stored (out, in),
# as our nn.Linear holds them (HF's Conv1D holds them transposed).
NAMES = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
         "attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
         "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# The largest difference each type may make, relative to the tensor's largest magnitude (module docstring).
BOUNDS = {"f32": 0.0, "f16": 2.0**-11, "q8_0": 1 / 254 + 2.0**-11}


class ConverterUnavailable(RuntimeError):
    """pip could not fetch the sdist (offline, or the version is gone)."""


def converter(cache: Path = CACHE) -> Path:
    """The path of convert_hf_to_gguf.py, fetched and unpacked into `cache` the first time."""
    script = cache / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                              SDIST, "-d", tmp], capture_output=True, text=True, timeout=600)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if got.returncode or not archives:
            raise ConverterUnavailable(f"pip download {SDIST} failed: {(got.stderr or got.stdout).strip()[-300:]}")
        partial = cache.with_name(cache.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)  # an extraction cut short before
        with tarfile.open(archives[0]) as sdist:
            members = []
            for member in sdist.getmembers():
                inner = member.name.partition("/vendor/llama.cpp/")[2]
                if member.isfile() and inner.startswith(PARTS):
                    member.name = inner
                    members.append(member)
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python 3.10.12+, 3.11.4+
            sdist.extractall(partial, members=members, **safe)
        partial.rename(cache)
    return script


def convert(export: Path, outtype: str, out: Path) -> float:
    """Run the converter on the HF folder `export`; return its seconds. RuntimeError with its last lines if it
    fails (the KeyError 'n_ctx' of an export without it)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(converter()), str(export), "--outfile", str(out), "--outtype", outtype],
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def our_key(name: str) -> str:
    """Our state dict's key of a GGUF tensor name (`blk.0.attn_qkv.weight` -> `transformer.h.0.attn.c_attn.weight`)."""
    parts = name.split(".")
    if parts[0] == "blk":
        return f"transformer.h.{parts[1]}.{NAMES[parts[2]]}.{parts[3]}"
    return f"{NAMES[parts[0]]}.{parts[1]}"


def read_back(path: Path, model: GPT) -> dict[str, float | int | str]:
    """What the GGUF file says (context length, tokens, end-of-text id) and its largest relative difference from
    `model`'s weights, over every tensor."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    ours = model.state_dict()
    worst, worst_name = 0.0, ""
    for tensor in reader.tensors:
        mine = ours[our_key(tensor.name)].float().numpy()
        mine = mine[: model.config.vocab_size] if tensor.name == "token_embd.weight" else mine  # no padding rows
        theirs = dequantize(tensor.data, tensor.tensor_type).reshape(mine.shape).astype(np.float64)
        scale = float(np.abs(mine).max()) or 1.0
        if (diff := float(np.abs(theirs - mine).max()) / scale) >= worst:
            worst, worst_name = diff, tensor.name
    return {"context_length": int(reader.fields["gpt2.context_length"].contents()),
            "tokens": len(reader.fields["tokenizer.ggml.tokens"].data),
            "eos_token_id": int(reader.fields["tokenizer.ggml.eos_token_id"].contents()),
            "tensors": len(reader.tensors), "max_rel_diff": worst, "worst_tensor": worst_name,
            "bytes": path.stat().st_size}


def small_export(folder: Path) -> Path:
    """A random GPT-2 (2 layers, 64 wide, 128 positions) exported as our trainer exports."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128)).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", default=None, help="an HF folder written by this project (default: a small one)")
    parser.add_argument("--types", default="f32,f16,q8_0", help="the converter's --outtype values to try")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        export = Path(args.export) if args.export else small_export(Path(tmp) / "export")
        model = GPT.from_pretrained(export)
        print(f"converter: {converter()} ({SDIST})")
        results = {}
        for outtype in args.types.split(","):
            out = Path(tmp) / f"model-{outtype}.gguf"
            seconds = convert(export, outtype, out)
            results[outtype] = {"seconds": round(seconds, 2), **read_back(out, model)}
            r = results[outtype]
            print(f"{outtype:>5}: {seconds:5.1f} s, {r['bytes'] / 1e6:7.2f} MB, context {r['context_length']}, "
                  f"{r['tokens']} tokens, eos {r['eos_token_id']}, largest difference {r['max_rel_diff']:.2e} of a "
                  f"tensor's largest value ({r['worst_tensor']}; bound {BOUNDS.get(outtype, float('nan')):.2e})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
