"""Greedy generations of the real SmolLM2 and Gemma 3 files against llama.cpp (optional: skipped
when llama-cpp-python is not installed, as in CI, where it would take ~8 minutes to build)."""

import contextlib

import numpy as np
import pytest
from llama_cpp_oracle import import_llama_cpp

import pagelm
from pagelm.chat.tokenizer import Tokenizer
from pagelm.engine.sampling import SamplingParams

llama_cpp = import_llama_cpp()

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "Water boils at a temperature of", "The three primary colors are"]
NEW_TOKENS = 32


@contextlib.contextmanager
def _without_amx():
    """peers.md: llama.cpp's AMX matmul path crashes on these machines for prompts > 1 token."""
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


def _llama_cpp_greedy(path: str, prompt: list[int]) -> list[int]:
    with _without_amx():  # a fresh context per prompt: Llama.reset() leaves state behind
        llm = llama_cpp.Llama(path, n_ctx=256, n_threads=2, verbose=False, type_k=0, type_v=0)  # F32 KV
    n_vocab = llm.n_vocab()
    tokens, feed = [], prompt
    for _ in range(NEW_TOKENS):
        llm.eval(feed)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        tokens.append(int(logits.argmax()))
        feed = tokens[-1:]
    return tokens


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_greedy_tokens_match_llama_cpp(request, fixture):
    path = request.getfixturevalue(fixture)
    model = pagelm.load(path, dtype="float32")
    tokenizer = Tokenizer.from_gguf(model.file)
    shared = []
    for text in PROMPTS:
        prompt = tokenizer.encode(text, add_special=True)
        expected = _llama_cpp_greedy(path, prompt)
        got = list(model.session(256).generate(prompt, SamplingParams(max_tokens=NEW_TOKENS)))
        shared.append(next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), len(got)))
    # pagelm matches transformers token for token (test_real_models.py). llama.cpp multiplies the
    # Q4_1 / Q4_K blocks by 8-bit-quantized activations, so at a near-tie the two part: measured
    # shared prefixes were 8–30 tokens (SmolLM2) and 5–32 (Gemma 3). Every prompt must share its
    # first 4 greedy tokens, and some prompt at least 24.
    assert min(shared) >= 4 and max(shared) >= 24, shared
