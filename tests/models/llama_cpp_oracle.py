"""llama.cpp as a test oracle: its bindings, or a skip that says why they cannot be used."""

import contextlib

import numpy as np
import pytest


def import_llama_cpp():
    """The `llama_cpp` module; skips (the calling test, or the module when called at its top) when
    llama-cpp-python is not installed, or is installed without a library it can load (bindings
    built with LLAMA_BUILD=OFF and no LLAMA_CPP_LIB_PATH)."""
    try:
        import llama_cpp
    except ImportError:
        pytest.skip("llama-cpp-python is not installed (../shared/peers.md)", allow_module_level=True)
    except OSError as e:
        pytest.skip(f"llama-cpp-python is installed but its library did not load ({e}); "
                    "set LLAMA_CPP_LIB_PATH to a llama.cpp build", allow_module_level=True)
    return llama_cpp


@contextlib.contextmanager
def _without_amx():
    """peers.md: llama.cpp's AMX matmul path crashes on these machines for prompts > 1 token."""
    llama_cpp = import_llama_cpp()
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_cpp.llama_model_default_params = llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = llama_cpp.llama_model_default_params = defaults


def llama_cpp_greedy(path: str, prompt: list[int], new_tokens: int) -> list[int]:
    """llama.cpp's greedy tokens after `prompt` (F32 KV cache, 2 threads)."""
    llama_cpp = import_llama_cpp()
    with _without_amx():  # a fresh context per prompt: Llama.reset() leaves state behind
        llm = llama_cpp.Llama(path, n_ctx=256, n_threads=2, verbose=False, type_k=0, type_v=0)  # F32 KV
    n_vocab = llm.n_vocab()
    tokens, feed = [], prompt
    for _ in range(new_tokens):
        llm.eval(feed)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        tokens.append(int(logits.argmax()))
        feed = tokens[-1:]
    return tokens
