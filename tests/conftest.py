"""Models for the tests: real ones pulled once into the pagelm store (PAGELM_HOME or ~/.cache/pagelm),
synthetic ones written once per test session."""

import os

import pytest
from hypothesis import settings

from pagelm.sources import store

# Property tests bound their work (example counts), not their time: a per-example deadline fails
# on a loaded or slow machine (CI) for no fault of the code.
settings.register_profile("pagelm", deadline=None)
settings.load_profile("pagelm")

if "PYTEST_XDIST_WORKER" in os.environ:
    # Two workers share the cores: OpenMP threads (torch's, numba's) that spin after each parallel
    # region would take them from the other worker; set before either library loads its runtime.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_configure(config):
    """Compile every kernel once, on two processes, before any test (or xdist worker) needs one:
    otherwise each worker and each server process compiles what it needs first, one at a time."""
    if not hasattr(config, "workerinput"):
        from pagelm.quant.compile_progress import CompileProgress
        from pagelm.quant.precompile import precompile

        with CompileProgress(live=False):
            precompile()


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    return str(store.pull("smollm2-135m"))


@pytest.fixture(scope="session")
def gemma3_gguf() -> str:
    return str(store.pull("gemma3-270m"))


def _tiny_q8_gguf(tmp_path_factory, arch: str) -> str:
    """A tiny random transformers model of `arch` (untied; token ids up to 4095, as the engine's tests
    use) as a Q8_0 GGUF (hf_gguf)."""
    pytest.importorskip("transformers")
    from hf_gguf import tiny_decoder, write_decoder_gguf
    from pagelm.quant.types import GGMLType

    path = str(tmp_path_factory.mktemp(arch) / f"{arch}-tiny-q8_0.gguf")
    write_decoder_gguf(tiny_decoder(f"{arch}-untied", vocab=4096), path, arch, GGMLType.Q8_0)
    return path


@pytest.fixture(scope="session")
def qwen2_tiny_gguf(tmp_path_factory) -> str:
    return _tiny_q8_gguf(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def qwen3_tiny_gguf(tmp_path_factory) -> str:
    return _tiny_q8_gguf(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def lfm2_tiny_gguf(tmp_path_factory) -> str:
    """A tiny random transformers LFM2 (token ids up to 4095) as a Q8_0 GGUF (lfm2_hf)."""
    pytest.importorskip("transformers")
    from lfm2_hf import build_hf_model, hf_to_gguf
    from pagelm.quant.types import GGMLType

    path = str(tmp_path_factory.mktemp("lfm2") / "lfm2-tiny-q8_0.gguf")
    hf_to_gguf(build_hf_model(vocab=4096), path, GGMLType.Q8_0)
    return path


@pytest.fixture(scope="session")
def qwen3moe_tiny_gguf(tmp_path_factory) -> str:
    return _tiny_q8_gguf(tmp_path_factory, "qwen3moe")


@pytest.fixture(scope="session")
def gpt_oss_tiny_gguf(tmp_path_factory) -> str:
    """pagelm's synthetic gpt-oss-20b-tiny (MXFP4 experts, Q8_0 matrices, a window of 8, token ids up to 4095)."""
    from pagelm.tools.synth import SHAPES, write_model

    path = str(tmp_path_factory.mktemp("gpt-oss") / "gpt-oss-tiny.gguf")
    write_model(path, SHAPES["gpt-oss-20b-tiny"], seed=2)
    return path


@pytest.fixture(scope="session")
def qwen35_chat_gguf(tmp_path_factory) -> str:
    """A synthetic Qwen3.5 with tiny layers and the real vocabulary, tokenizer and chat template."""
    from pagelm.tools.synth import SHAPES, write_model

    path = tmp_path_factory.mktemp("qwen35-chat") / "qwen3.5-tiny-chat.gguf"
    write_model(str(path), SHAPES["qwen3.5-tiny-chat"], seed=0, name="synthetic qwen3.5-tiny-chat")
    return str(path)


@pytest.fixture(scope="session")
def qwen35_mtp_chat_gguf(tmp_path_factory) -> str:
    """qwen35_chat_gguf's geometry with a multi-token-prediction layer after its trunk."""
    from dataclasses import replace

    from pagelm.tools.synth import SHAPES, write_model

    path = tmp_path_factory.mktemp("qwen35-mtp-chat") / "qwen3.5-tiny-chat-mtp.gguf"
    write_model(str(path), replace(SHAPES["qwen3.5-tiny-chat"], mtp_layers=1), seed=0, name="synthetic MTP")
    return str(path)


@pytest.fixture(scope="session")
def harmony_gguf(tmp_path_factory) -> str:
    """qwen35_chat_gguf's layers and vocabulary chatting in harmony, with gpt-oss's real template."""
    from harmony_model import write_harmony_model

    return write_harmony_model(str(tmp_path_factory.mktemp("harmony") / "harmony-tiny-chat.gguf"))


@pytest.fixture(scope="session")
def smollm2_chat(smollm2_gguf):
    """SmolLM2 opened for chat (model, tokenizer, template), shared by the in-process tests."""
    from pagelm.chat.model import ChatModel

    return ChatModel.open(smollm2_gguf)


@pytest.fixture(scope="session")
def qwen35_chat(qwen35_chat_gguf):
    from pagelm.chat.model import ChatModel

    return ChatModel.open(qwen35_chat_gguf)


@pytest.fixture(scope="session")
def transformers_tokenizer():
    """transformers' tokenizer of a real GGUF (converted from the file's metadata: ~20 s for
    Gemma 3), built once per file for every test that compares against it."""
    transformers = pytest.importorskip("transformers")
    built = {}

    def get(path: str):
        if path not in built:
            built[path] = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                                     gguf_file=os.path.basename(path))
        return built[path]
    return get


@pytest.fixture(scope="session")
def embedding_gemma(tmp_path_factory):
    """(directory, transformers model, dense projections) of a tiny random EmbeddingGemma (tests/embedding_model.py)."""
    from embedding_model import write

    path = tmp_path_factory.mktemp("embeddinggemma")
    model, dense = write(path)
    return str(path), model, dense
