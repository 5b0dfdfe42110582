"""Embeddings from a tiny random EmbeddingGemma (tests/embedding_model.py) against transformers
through the sentence-transformers pipeline: vectors within 1e-5 in float32 (1e-4 from a bf16
directory), the same bits alone and among 32 others, Matryoshka truncation, and a generative model
refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from embedding_model import VOCAB, reference, write

from pagelm.engine.embed import Embedder, NotAnEmbeddingModel
from pagelm.engine.load import load_model
from pagelm.errors import PagelmError

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


def test_a_vector_is_the_same_bits_alone_and_among_32_others(embedding_gemma):
    embedder = Embedder.of(load_model(embedding_gemma[0], dtype="bfloat16"))
    rng = np.random.default_rng(7)
    others = [list(rng.integers(3, VOCAB, int(rng.integers(1, 60)))) for _ in range(32)]
    alone = embedder.embed(INPUTS[2])
    together = embedder.embed_all(others[:16] + [INPUTS[2]] + others[16:])
    assert together.shape == (33, embedder.dimensions)
    assert together[16].tobytes() == alone.tobytes()


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

    from embedding_model import write_gguf

    from pagelm.quant.types import GGMLType

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
    import json

    import transformers

    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, initializer_range=0.2,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      tie_word_embeddings=True)
    torch.manual_seed(2)
    model = transformers.Qwen3Model(config).eval()
    model.save_pretrained(tmp_path)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    embedder = Embedder.of(load_model(str(tmp_path), dtype="float32"))
    assert embedder.head.pooling == "last" and embedder.dimensions == 64
    for ids in INPUTS:
        with torch.inference_mode():
            last = model(torch.tensor([ids])).last_hidden_state[0, -1]
        assert _rel(embedder.embed(ids), (last / last.norm()).numpy()) <= 1e-5
