"""Embeddings from a tiny random EmbeddingGemma (tests/embedding_model.py) against transformers
through the sentence-transformers pipeline: vectors within 1e-5 in float32 (1e-4 from a bf16
directory), the same bits alone and among 32 others (EmbeddingGemma and Qwen3-Embedding, every
weights mode), passes bounded by their tokens, Matryoshka truncation, and a generative model refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from embedding_model import VOCAB, reference, write, write_gguf, write_qwen3_embedding

from pagelm.engine.embed import Embedder, NotAnEmbeddingModel
from pagelm.engine.load import load_model
from pagelm.errors import PagelmError
from pagelm.quant.types import GGMLType

INPUTS = [list(np.random.default_rng(i).integers(3, VOCAB, n)) for i, n in enumerate([1, 5, 17, 40])]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("weights", ["mapped", "dense"])
def test_vectors_match_transformers_through_the_pipeline(embedding_gemma, weights):
    path, model, dense = embedding_gemma
    embedder = Embedder.of(load_model(path, dtype="float32", weights=weights))
    assert embedder.dimensions == dense[-1].shape[0] and embedder.head.pooling == "mean"
    for ids in INPUTS:
        vector = embedder.embed(ids)
        assert _rel(vector, reference(model, dense, ids)) <= 1e-5, len(ids)
        assert abs(float(np.linalg.norm(vector)) - 1) < 1e-6


def test_a_bf16_directory_matches_transformers_on_the_same_weights(tmp_path):
    import transformers

    _, dense = write(tmp_path, torch.bfloat16, seed=1)
    # read back in float32: the model converted to bf16 in memory also rounded its rope frequencies
    model = transformers.AutoModel.from_pretrained(tmp_path, dtype=torch.float32)
    embedder = Embedder.of(load_model(str(tmp_path), dtype="float32"))
    for ids in INPUTS:
        assert _rel(embedder.embed(ids), reference(model, dense, ids)) <= 1e-4


@pytest.fixture(scope="module")
def packing_models(embedding_gemma, tmp_path_factory):
    """name -> path: EmbeddingGemma as GGUF files (Q8_0, F32) and Qwen3-Embedding as a directory."""
    _, model, dense = embedding_gemma
    folder = tmp_path_factory.mktemp("packing")
    paths = {}
    for matrix_type in ("Q8_0", "F32"):
        paths[f"gemma-{matrix_type}"] = str(folder / f"embeddinggemma-{matrix_type}.gguf")
        write_gguf(model, dense, folder / f"embeddinggemma-{matrix_type}.gguf", GGMLType[matrix_type])
    (folder / "qwen3").mkdir()
    write_qwen3_embedding(folder / "qwen3")
    paths["qwen3"] = str(folder / "qwen3")
    return paths


# lengths on both sides of every row limit a pass's arithmetic could switch at (MAX_GEMV_ROWS 16,
# the few-row norms' 64, torch's small GEMMs), past the fixture's sliding window, and random ones
PACKED_LENGTHS = [1, 2, 5, 11, 12, 16, 17, 40, 63, 64, 65, 100] + \
    [int(n) for n in np.random.default_rng(3).integers(1, 101, 21)]


@pytest.mark.parametrize("name, dtype, weights", [
    ("gemma-Q8_0", "bfloat16", "mapped"), ("gemma-Q8_0", "float32", "mapped-int8"), ("gemma-F32", "float32", "dense"),
    ("gemma-F32", "bfloat16", "dense"), ("qwen3", "float32", "mapped"), ("qwen3", "bfloat16", "dense")])
def test_a_vector_is_the_same_bits_alone_and_among_32_others(packing_models, name, dtype, weights, monkeypatch):
    """33 inputs of 1..100 tokens embedded together (one pass): each the bits of its input alone."""
    embedder = Embedder.of(load_model(packing_models[name], dtype=dtype, weights=weights))
    rng = np.random.default_rng(7)
    inputs = [list(rng.integers(3, VOCAB, n)) for n in PACKED_LENGTHS]
    passes = []
    encode_all = embedder.model.network.encode_all
    monkeypatch.setattr(embedder.model.network, "encode_all", lambda xs: passes.append(len(xs)) or encode_all(xs))
    together = embedder.embed_all(inputs)
    assert passes == [33] and together.shape == (33, embedder.dimensions)
    for ids, vector in zip(inputs, together):
        assert np.array_equal(embedder.embed(ids), vector), len(ids)
    assert len(passes) == 34


def test_passes_are_bounded_by_their_tokens(embedding_gemma, monkeypatch):
    """Inputs past a pass's token budget go into further passes (one too long for it, alone), in
    order, with the same bits."""
    from pagelm.engine import embed

    embedder = Embedder.of(load_model(embedding_gemma[0], dtype="float32"))
    rng = np.random.default_rng(5)
    inputs = [list(rng.integers(3, VOCAB, n)) for n in (30, 50, 90, 10, 20, 70)]
    together = embedder.embed_all(inputs)
    passes = []
    encode_all = embedder.model.network.encode_all
    monkeypatch.setattr(embedder.model.network, "encode_all", lambda xs: passes.append(len(xs)) or encode_all(xs))
    monkeypatch.setattr(embed, "PASS_TOKENS", 80)
    assert np.array_equal(embedder.embed_all(inputs), together)
    assert passes == [2, 1, 2, 1]  # 30+50 | 90 | 10+20 | 70
    assert embed._passes([3000, 2000, 5000, 10, 4086], 4096) == [[0], [1], [2], [3, 4]]


def test_dimensions_keep_the_first_values_normalized_again(embedding_gemma):
    embedder = Embedder.of(load_model(embedding_gemma[0], dtype="float32"))
    full, short = embedder.embed(INPUTS[1]), embedder.embed(INPUTS[1], dimensions=16)
    assert short.shape == (16,) and abs(float(np.linalg.norm(short)) - 1) < 1e-6
    np.testing.assert_allclose(short, full[:16] / np.linalg.norm(full[:16]), rtol=1e-6)
    with pytest.raises(PagelmError, match="dimensions must be in"):
        embedder.embed(INPUTS[1], dimensions=embedder.dimensions + 1)


def test_a_later_token_changes_an_earlier_ones_state(embedding_gemma):
    """Attention both ways: EmbeddingGemma is no causal decoder (a causal pass would agree here)."""
    model = load_model(embedding_gemma[0], dtype="float32")
    ids = INPUTS[3]
    first = model.network.encode(model.embed(np.array(ids)))[0]
    changed = model.network.encode(model.embed(np.array(ids[:-1] + [(ids[-1] + 1) % VOCAB])))[0]
    assert not torch.equal(first, changed)


def test_a_generative_model_is_not_an_embedding_model(smollm2_gguf):
    with pytest.raises(NotAnEmbeddingModel, match="not an embedding model"):
        Embedder.of(load_model(smollm2_gguf))


def test_the_cli_prints_one_line_per_text_equal_to_the_library(embedding_gemma):
    import json
    import subprocess
    import sys

    from pagelm.chat.model import ChatModel

    path = embedding_gemma[0]
    out = subprocess.run([sys.executable, "-m", "pagelm", "embed", path, "the quick fox", "lazy dog",
                          "--dimensions", "32", "--prompt-name", "query", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    chat = ChatModel.open(path, dtype="float32")
    embedder = Embedder.of(chat.model)
    for i, text in enumerate(["the quick fox", "lazy dog"]):
        tokens = chat.tokenizer.encode_input("task: search result | query: " + text)
        assert tokens[0] == 2 and tokens[-1] == 1  # <bos> … <eos>, as its post-processor frames an input
        assert lines[i]["index"] == i and lines[i]["tokens"] == len(tokens)
        assert lines[i]["embedding"] == embedder.embed(tokens, 32).tolist()


def test_run_refuses_an_embedding_model(embedding_gemma):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pagelm", "run", embedding_gemma[0], "Hi"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 2 and "is an embedding model" in out.stderr and "pagelm embed" in out.stderr


def test_a_long_text_is_cut_inside_its_frame(embedding_gemma):
    from pagelm.chat.model import ChatModel

    tokenizer = ChatModel.open(embedding_gemma[0]).tokenizer
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 5)
    whole, cut = tokenizer.encode_input(text), tokenizer.encode_input(text, limit=10)
    assert len(whole) > 10 and cut == whole[:9] + whole[-1:]  # <bos> and 8 text tokens, then <eos>
    assert tokenizer.encode_input("fox", limit=10) == tokenizer.encode_input("fox")


@pytest.mark.parametrize("matrix_type", ["F32", "Q8_0"])
def test_a_gguf_written_as_llama_cpp_writes_embeddinggemma_gives_the_same_vectors(embedding_gemma, tmp_path,
                                                                                     matrix_type):
    """Within 1e-5 of transformers run on what the file holds (Q8_0 values decoded by gguf.quants)."""
    import copy

    _, model, dense = embedding_gemma
    gguf_path = tmp_path / f"embeddinggemma-{matrix_type}.gguf"
    held, held_dense = write_gguf(model, dense, gguf_path, GGMLType[matrix_type])
    reference_model = copy.deepcopy(model)
    reference_model.load_state_dict(held)
    embedder = Embedder.of(load_model(str(gguf_path), dtype="float32"))
    assert embedder.head.pooling == "mean" and len(embedder.head.dense) == 2
    for ids in INPUTS:
        assert _rel(embedder.embed(ids), reference(reference_model, held_dense, ids)) <= 1e-5


def test_a_qwen3_embedding_directory_pools_the_last_token(tmp_path):
    """Qwen3-Embedding's layout: a Qwen3 base model, last-token pooling, normalization, no projection."""
    model = write_qwen3_embedding(tmp_path)
    embedder = Embedder.of(load_model(str(tmp_path), dtype="float32"))
    assert embedder.head.pooling == "last" and embedder.dimensions == 64
    for ids in INPUTS:
        with torch.inference_mode():
            last = model(torch.tensor([ids])).last_hidden_state[0, -1]
        assert _rel(embedder.embed(ids), (last / last.norm()).numpy()) <= 1e-5
