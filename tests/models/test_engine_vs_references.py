"""The whole engine (mapped embedding → qwen35 → mapped head kernel → sampler) against transformers
and, when installed, llama.cpp, on tiny random Qwen3.5 models converted to GGUF."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llama_cpp_oracle import llama_cpp_greedy
from qwen35_hf import VARIANTS, build_hf_model, hf_logits, hf_to_gguf

import pagelm
from pagelm.engine.sampling import SamplingParams

PROMPT_LEN = 64
TOL = 1e-3


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request, tmp_path_factory):
    variant = VARIANTS[request.param]
    hf = build_hf_model(variant, seed=3)
    path = str(tmp_path_factory.mktemp("engine") / f"{variant.name}.gguf")
    hf_to_gguf(hf, path)
    prompt = np.random.default_rng(11).integers(0, variant.vocab, PROMPT_LEN).tolist()
    return variant, hf, path, prompt


@pytest.mark.parametrize("embedding", ["mapped", "dense"])
def test_prefill_decode_and_restore_match_transformers(case, embedding):
    _, hf, path, prompt = case
    reference = hf_logits(hf, torch.tensor(prompt)).numpy()
    model = pagelm.load(path, embedding=embedding, dtype="float32")
    session = model.session(max_len=PROMPT_LEN)

    assert np.abs(session.prefill(prompt) - reference[-1]).max() <= TOL

    session = model.session(max_len=PROMPT_LEN)
    session.prefill(prompt[:1])
    for i, token in enumerate(prompt[1:], start=1):
        assert np.abs(session.decode(token) - reference[i]).max() <= TOL, f"decode step {i}"

    session = model.session(max_len=PROMPT_LEN)
    session.prefill(prompt[:40])
    checkpoint = session.checkpoint()
    session.prefill(prompt[40:50][::-1])  # a detour the restore must undo
    session.restore(checkpoint)
    assert np.abs(session.prefill(prompt[40:]) - reference[-1]).max() <= TOL


def test_greedy_tokens_match_llama_cpp(case):
    _, _, path, prompt = case
    expected = llama_cpp_greedy(path, prompt[:16], 32)
    session = pagelm.load(path, dtype="float32").session(max_len=64)
    assert list(session.generate(prompt[:16], SamplingParams(max_tokens=32))) == expected


def test_dense_and_mapped_agree_bit_for_bit_in_bf16(case):
    _, _, path, prompt = case
    results = []
    for embedding in ("dense", "mapped"):
        session = pagelm.load(path, embedding=embedding, dtype="bfloat16").session(max_len=64)
        tokens = list(session.generate(prompt[:24], SamplingParams(max_tokens=16)))
        results.append((tokens, session.logits.view(np.uint32).copy()))
    assert results[0][0] == results[1][0]
    assert np.array_equal(results[0][1], results[1][1])
