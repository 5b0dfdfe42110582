"""Greedy generations of the new families' synthetic files against llama.cpp (optional: skipped
when llama-cpp-python is not installed, as in CI). F32 weights, so that llama.cpp's products are
float32 as pagelm's are (its quantized ones multiply 8-bit activations): Qwen3, Qwen3-MoE, Qwen2.5,
Llama 3.2 (its rope scaled by rope_freqs), LFM2 (convolutions and attention) and Qwen3.5-MoE give the same 32 tokens.
(With a Q8_0 token_embd, as these files had until the writer's F32 was taken for "not given", LFM2's
logits were 0.7 % off llama.cpp's from the first token: its head's 8-bit activations.)"""

from dataclasses import replace

import pytest
from llama_cpp_oracle import import_llama_cpp, llama_cpp_greedy

import pagelm
from pagelm.engine.sampling import SamplingParams
from pagelm.quant.types import GGMLType
from pagelm.tools.synth import SHAPES, write_model

import_llama_cpp()

NEW_TOKENS = 32
PROMPT = [11, 22, 33, 44, 55, 66, 77]


@pytest.mark.parametrize("shape", ["qwen3-tiny", "qwen3-30b-a3b-tiny", "qwen2.5-tiny", "llama3.2-tiny", "lfm2-tiny",
                                   "qwen3.5-35b-a3b-tiny"])
def test_greedy_tokens_match_llama_cpp(tmp_path, shape):
    path = str(tmp_path / f"{shape}.gguf")
    untied = SHAPES[shape].output_type is not None  # an F32 head too (qwen3moe's is untied)
    write_model(path, replace(SHAPES[shape], output_type=GGMLType.F32 if untied else None), layer_type=GGMLType.F32,
                embedding_type=GGMLType.F32, seed=3, name=shape)
    got = list(pagelm.load(path, dtype="float32").session(256).generate(PROMPT, SamplingParams(max_tokens=NEW_TOKENS)))
    assert got == llama_cpp_greedy(path, PROMPT, NEW_TOKENS)
