"""An export converts with llama.cpp's own converter (`convert_hf_to_gguf.py`, from the llama-cpp-python sdist that
pip fetches: benchmarks/bench_gguf.py) into a GGUF file that holds every weight exactly, the context length and
GPT-2's tokens. Skipped, with the reason, where pip cannot fetch the converter."""
from __future__ import annotations

import pytest

from benchmarks.bench_gguf import ConverterUnavailable, convert, converter, read_back, small_export
from model import GPT


@pytest.mark.slow  # a converter run imports torch and transformers: about 10 s (and fetching it once, about 30 s)
def test_llama_cpps_converter_writes_the_export_exactly(tmp_path):
    """Seen to catch: config.json without `n_ctx` (the converter stopped with KeyError: 'n_ctx', issue 60)."""
    try:
        converter()
    except ConverterUnavailable as err:
        pytest.skip(str(err))
    export = small_export(tmp_path / "export")
    convert(export, "f32", tmp_path / "model.gguf")
    found = read_back(tmp_path / "model.gguf", GPT.from_pretrained(export))
    assert (found["context_length"], found["tokens"], found["eos_token_id"]) == (128, 50257, 50256)
    assert found["tensors"] == 4 + 2 * 12 and found["max_rel_diff"] == 0.0  # every weight, bit for bit
