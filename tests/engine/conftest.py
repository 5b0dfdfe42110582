"""The tiny Qwen3.5 files the engine tests share."""

import pytest

from synth_files import synth


@pytest.fixture(scope="module")
def qwen_tiny(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("m") / "qwen3.5-tiny-gqa.gguf", "qwen3.5-tiny-gqa", "--layer-type", "Q8_0")


@pytest.fixture(scope="module")
def qwen_tiny_k(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("m") / "qwen3.5-tiny-k.gguf", "qwen3.5-tiny-k", "--mix", "q4_k_m")


@pytest.fixture(scope="module")
def qwen_moe_tiny(tmp_path_factory):
    """qwen35moe: 8 experts, 2 a token, and a shared expert in every layer."""
    return synth(tmp_path_factory.mktemp("m") / "qwen3.5-35b-a3b-tiny.gguf", "qwen3.5-35b-a3b-tiny")
