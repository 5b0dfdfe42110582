"""Embeddings over HTTP from a real `pagelm serve` of a tiny random EmbeddingGemma: the official
`openai` client on /v1/embeddings and the official `ollama` client on /api/embed get the vectors
`pagelm embed` prints, bit for bit; many inputs of one request get the bits of each alone; inputs past the context, chat asked of an embedding model and
vectors asked of a chat model get 400s naming why."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest

TEXTS = ["the quick brown fox", "a vector for every text", "lazy dog"]


@pytest.fixture(scope="module")
def cli_vectors(embedder, embedding_gemma) -> list[list[float]]:
    out = subprocess.run([sys.executable, "-m", "pagelm", "embed", embedding_gemma[0], *TEXTS, "--dtype", "float32"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return [json.loads(line)["embedding"] for line in out.stdout.splitlines()]


def test_the_openai_client_gets_the_clis_vectors(embedder, cli_vectors):
    reply = embedder.openai().embeddings.create(model=embedder.model, input=TEXTS, encoding_format="float")
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert [d.embedding for d in reply.data] == cli_vectors
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(TEXTS)


def test_base64_and_token_ids_and_dimensions(embedder, cli_vectors):
    with embedder.client() as client:
        r = client.post("/v1/embeddings", json={"model": embedder.model, "input": TEXTS[0], "encoding_format": "base64"})
        assert r.status_code == 200, r.text
        vector = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
        assert vector.tolist() == cli_vectors[0]
        tokens = client.post("/v1/embeddings", json={"model": embedder.model, "input": [[2, 40, 41, 42], [2, 7]]})
        assert tokens.status_code == 200 and len(tokens.json()["data"]) == 2
        short = client.post("/v1/embeddings", json={"model": embedder.model, "input": TEXTS[0], "dimensions": 8})
        values = np.array(short.json()["data"][0]["embedding"])
        assert values.shape == (8,) and abs(np.linalg.norm(values) - 1) < 1e-6


def test_the_ollama_client_gets_the_clis_vectors(embedder, cli_vectors):
    import ollama

    client = ollama.Client(host=embedder.url)
    assert [list(v) for v in client.embed(model=embedder.model, input=TEXTS).embeddings] == cli_vectors
    assert list(client.embeddings(model=embedder.model, prompt=TEXTS[1]).embedding) == cli_vectors[1]
    assert "embedding" in client.show(embedder.model).capabilities


def test_many_inputs_in_one_request_each_get_the_bits_of_their_input_alone(embedder):
    """33 inputs of 1..64 tokens computed together: each vector is the one a request of that input
    alone gets, on both routes."""
    rng = np.random.default_rng(11)
    inputs = [rng.integers(3, 300, n).tolist() for n in [1, 17, 64, *rng.integers(1, 65, 30)]]
    with embedder.client() as client:
        together = client.post("/v1/embeddings", json={"model": embedder.model, "input": inputs})
        assert together.status_code == 200, together.text
        vectors = [d["embedding"] for d in together.json()["data"]]
        assert len(vectors) == 33
        for ids, vector in zip(inputs, vectors):
            alone = client.post("/v1/embeddings", json={"model": embedder.model, "input": [ids]})
            assert alone.json()["data"][0]["embedding"] == vector, len(ids)
        texts = [" ".join(["lazy dog"] * k) for k in range(1, 12)]
        ollama = client.post("/api/embed", json={"model": embedder.model, "input": texts}).json()["embeddings"]
        for text, vector in zip(texts, ollama):
            assert client.post("/api/embed", json={"model": embedder.model, "input": text}).json()["embeddings"] == \
                [vector]


def test_an_input_past_the_context_is_cut_when_allowed_else_refused(embedder):
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)
    with embedder.client() as client:
        refused = client.post("/v1/embeddings", json={"model": embedder.model, "input": long})
        assert refused.status_code == 400 and "context of 64" in refused.json()["error"]["message"]
        refused = client.post("/api/embed", json={"model": embedder.model, "input": long, "truncate": False})
        assert refused.status_code == 400 and "context of 64" in refused.json()["error"]
        cut = client.post("/api/embed", json={"model": embedder.model, "input": [long, "x"]})
        assert cut.status_code == 200 and cut.json()["prompt_eval_count"] == 64 + 3  # "x" framed: <bos> x <eos>


@pytest.mark.parametrize("body, words", [
    ({"input": []}, ["input"]), ({"input": [1.5]}, ["input[0]"]), ({"input": [[1, -2]]}, ["input[0]"]),
    ({"input": "x", "encoding_format": "hex"}, ["encoding_format"]), ({"input": "x", "dimensions": 0}, ["dimensions"]),
    ({"input": "x", "dimensions": 4096}, ["dimensions", "at most"]), ({"input": [[2, 99999]]}, ["vocabulary"]),
])
def test_bad_embedding_requests_name_the_field(embedder, body, words):
    r = httpx.post(f"{embedder.url}/v1/embeddings", json={"model": embedder.model, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert all(word in r.json()["error"]["message"] for word in words), r.text


def test_chat_of_an_embedding_model_and_vectors_of_a_chat_model_are_400s(embedder, smol):
    r = httpx.post(f"{embedder.url}/v1/chat/completions", timeout=60,
                   json={"model": embedder.model, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
    r = httpx.post(f"{smol.url}/v1/embeddings", json={"model": smol.model, "input": "Hi"}, timeout=60)
    assert r.status_code == 400 and "not an embedding model" in r.json()["error"]["message"]
    r = httpx.post(f"{smol.url}/api/embed", json={"model": smol.model, "input": "Hi"}, timeout=60)
    assert r.status_code == 400 and "not an embedding model" in r.json()["error"]
