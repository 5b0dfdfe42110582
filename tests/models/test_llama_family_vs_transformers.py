"""qwen2, qwen3 and qwen3moe GGUF files (written from transformers' own tiny random models the way llama.cpp's
converter writes them, F32, Q8_0 and MXFP4, gpt-oss's expert codec) against transformers on the values
the file holds: prefill, decode and greedy tokens in every weights mode; batched decode and checkpoints
bit for bit."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import pagelm
from pagelm.quant import int8dot
from pagelm.quant.types import GGMLType

from hf_gguf import TINY, tiny_decoder, write_decoder_gguf
from hf_oracle import F32_REL_TOL, PROMPT, check_greedy, greedy, rel

pytest.importorskip("transformers")

@pytest.fixture(scope="module", params=[(c, t) for c in TINY for t in ("F32", "Q8_0", "MXFP4")], ids=lambda p: f"{p[0]}-{p[1]}")
def written(request, tmp_path_factory):
    """(GGUF path, transformers fp32 model holding the values the file holds)."""
    case, qtype = request.param
    model = tiny_decoder(case)
    path = str(tmp_path_factory.mktemp(case) / f"{case}-{qtype}.gguf")
    held = write_decoder_gguf(model, path, case.split("-")[0], GGMLType[qtype])
    reference = copy.deepcopy(model)
    missing, unexpected = reference.load_state_dict(held, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # a tied head is the embeddings
    return path, reference


@pytest.mark.parametrize("weights", ["mapped", "dense"])
def test_gguf_matches_transformers(written, weights):
    path, reference = written
    model = pagelm.load(path, weights=weights, dtype="float32")
    tokens, logits = greedy(model, PROMPT)
    check_greedy(reference, PROMPT, tokens, logits, F32_REL_TOL)
    with torch.inference_mode():  # the prefill's every row, not only its last
        ref = reference(torch.tensor([PROMPT])).logits[0].numpy()
    session = model.session(len(PROMPT))
    rows = [session.prefill(PROMPT[:3])] + [session.decode(t) for t in PROMPT[3:]]
    assert max(rel(row, r) for row, r in zip(rows, ref[2:])) <= F32_REL_TOL


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("weights, dtype", [("mapped", "float32"), ("mapped", "bfloat16"), ("dense", "float32"),
                                            ("dense", "bfloat16"), ("mapped-int8", "bfloat16")])
def test_batched_decode_and_restored_checkpoints_are_bit_identical(written, weights, dtype):
    """Sessions at different lengths, one restored from a checkpoint, decode in batches the bits each
    decodes alone; a checkpoint restored decodes the bits the session it was taken from decoded."""
    if weights == "mapped-int8" and not int8dot.available():
        pytest.skip("mapped-int8 needs AVX2")
    model = pagelm.load(written[0], weights=weights, dtype=dtype)
    prompts = [PROMPT, PROMPT[:3], [9]]
    batched, alone = ([model.session(64) for _ in prompts] for _ in range(2))
    for pair in zip(batched, alone, prompts):
        pair[0].prefill(pair[2])
        pair[1].prefill(pair[2])
    checkpoint = alone[0].checkpoint()
    restored = model.session(64)
    restored.restore(checkpoint)
    batched.append(restored)
    alone.append(alone[0])  # the restored session must follow the one it came from
    for _ in range(6):
        tokens = [int(np.argmax(s.logits)) for s in alone[:3]]
        tokens.append(tokens[0])
        rows = model.decode_batch(batched, tokens)
        singles = [s.decode(t) for s, t in zip(alone[:3], tokens)]
        for row, single in zip(rows, singles + singles[:1]):
            assert _same_bits(row, single)
