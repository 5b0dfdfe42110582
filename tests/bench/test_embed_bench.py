"""`pagelm bench embed` end to end on the tiny synthetic EmbeddingGemma: its table and contract lines,
and llama.cpp's half beside it where llama_cpp is installed (it is not in CI)."""

import importlib.util
import re

import numpy as np
import pytest

from pagelm import cli
from pagelm.bench.embed import lowest_cosine


def test_bench_embed_prints_inputs_per_second(tmp_path, capsys):
    from pagelm.tools.synth import SHAPES, write_model

    path = str(tmp_path / "embeddinggemma-tiny.gguf")
    write_model(path, SHAPES["embeddinggemma-tiny"], seed=0, name="synthetic embeddinggemma-tiny")
    code = cli.main(["bench", "embed", path, "--inputs", "3,1", "--tokens", "12", "--runs", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert re.search(r"^\| 1 \| [\d.]+ \| \d+ \|", out, re.M) and re.search(r"^\| 3 \| [\d.]+ \| \d+ \|", out, re.M)
    for n in (1, 3):
        assert re.search(rf"^inputs {n}: pagelm \d+\.\d\d inputs/s", out, re.M)
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama_cpp is not installed: llama.cpp's half not run")
    for n in (1, 3):
        assert re.search(rf"^inputs {n}: pagelm [\d.]+ inputs/s, llama\.cpp [\d.]+ inputs/s, [\d.]+×$", out, re.M)
    lowest = float(re.search(r"^vectors: lowest cosine to llama\.cpp's ([\d.]+) \(at least 0\.999\)$", out, re.M)[1])
    assert 0.999 <= lowest <= 1.0 + 1e-6


def test_bench_embed_goes_on_when_llama_cpp_fails(embedding_gemma, tmp_path, capsys):
    """A file llama.cpp aborts on (the fixture's last projection is narrower than its hidden size:
    GGML_ASSERT): pagelm's figures and llama.cpp's error, exit 0."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama_cpp is not installed")
    from embedding_model import write_gguf

    _, model, dense = embedding_gemma
    path = tmp_path / "narrow.gguf"
    write_gguf(model, dense, path)
    code = cli.main(["bench", "embed", str(path), "--inputs", "2", "--tokens", "5", "--runs", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert re.search(r"^inputs 2: pagelm [\d.]+ inputs/s$", out, re.M)
    assert re.search(r"^llama\.cpp: RuntimeError: its process ended \(exit -6\): .*dense_3_feat_out", out, re.M)


def test_lowest_cosine_is_the_worst_row():
    a = np.array([[1.0, 0.0], [1.0, 1.0]], np.float32)
    b = np.array([[2.0, 0.0], [1.0, 0.0]], np.float32)
    assert lowest_cosine(a, b) == pytest.approx(2**-0.5)
