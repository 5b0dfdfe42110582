"""Real `pagelm serve` processes on loopback, one per configuration, started once per session.

Each server runs with one compute thread (see serve_helpers.THREADS_ENV); helpers for talking to
them live in serve_helpers.py (a plain module, so test files can import it).
"""

import pytest
from serve_helpers import API_KEY, ServerProcess, Servers


@pytest.fixture(scope="session")
def servers():
    s = Servers()
    yield s
    s.stop_all()


# -- configurations ------------------------------------------------------------------------

@pytest.fixture(scope="session")
def smol(servers, smollm2_gguf) -> ServerProcess:
    """SmolLM2-135M, prefix cache on (defaults)."""
    return servers.get("smol", smollm2_gguf, "--ctx-len", "2048", "--max-tokens", "64")


@pytest.fixture(scope="session")
def smol_nocache(servers, smollm2_gguf) -> ServerProcess:
    return servers.get("smol_nocache", smollm2_gguf, "--ctx-len", "2048", "--max-tokens", "64",
                       "--prefix-slots", "0")


@pytest.fixture(scope="session")
def qwen(servers, qwen35_chat_gguf) -> ServerProcess:
    """The synthetic Qwen3.5 (real vocabulary and template, random tiny layers), cache on."""
    return servers.get("qwen", qwen35_chat_gguf, "--ctx-len", "2048", "--max-tokens", "64")


@pytest.fixture(scope="session")
def harmony_server(servers, harmony_gguf) -> ServerProcess:
    """A model that chats in harmony (gpt-oss's template and control tokens), cache on."""
    return servers.get("harmony", harmony_gguf, "--ctx-len", "2048", "--max-tokens", "64")


@pytest.fixture(scope="session")
def qwen_nocache(servers, qwen35_chat_gguf) -> ServerProcess:
    return servers.get("qwen_nocache", qwen35_chat_gguf, "--ctx-len", "2048", "--max-tokens", "64",
                       "--prefix-slots", "0")


@pytest.fixture(scope="session")
def strict(servers, smollm2_gguf) -> ServerProcess:
    """Tight limits and an API key: queue of 1, 1 MiB bodies, 64-token context; one more Host name
    and one more browser origin allowed."""
    return servers.get("strict", smollm2_gguf, "--ctx-len", "64", "--queue-size", "1", "--max-body-mib", "1",
                       "--allowed-host", "pagelm.test", "--allowed-origin", "https://app.example",
                       "--max-tokens", "32", api_key=API_KEY)


@pytest.fixture(scope="session")
def leaky(servers, smollm2_gguf) -> ServerProcess:
    """For the leak check: a small prefix cache so its bound does not dominate memory."""
    return servers.get("leaky", smollm2_gguf, "--ctx-len", "1024", "--prefix-cache-mib", "8", "--max-tokens", "8")




@pytest.fixture(scope="session")
def qwen35_tower(tmp_path_factory) -> str:
    """A tiny vision tower for the synthetic Qwen3.5, kept apart so that the qwen servers started
    without --mmproj find none beside the model."""
    from pagelm.tools.synth_tower import SHAPES, write_mmproj

    tower = str(tmp_path_factory.mktemp("tower") / "mmproj.gguf")
    write_mmproj(tower, SHAPES["qwen3.5-tiny-chat"], seed=1)
    return tower


@pytest.fixture(scope="session")
def qwen_vision(servers, qwen35_chat_gguf, qwen35_tower) -> ServerProcess:
    """The synthetic Qwen3.5 with its tiny vision tower (--mmproj), cache on."""
    return servers.get("qwen_vision", qwen35_chat_gguf, "--ctx-len", "2048", "--max-tokens", "8",
                       "--mmproj", qwen35_tower)


@pytest.fixture(scope="session")
def embedder(servers, embedding_gemma) -> ServerProcess:
    """A tiny random EmbeddingGemma (tests/embedding_model.py), float32, a 64-token context."""
    return servers.get("embed", embedding_gemma[0], "--ctx-len", "64", "--dtype", "float32")
