"""Speculative decoding's foundation: a verify pass over several tokens of one sequence gives each
position the bits decoding it alone gives, on every architecture, weights mode and dtype; rewinding
a pass leaves exactly the state decoding only the kept tokens leaves; and answers, greedy and
seeded, are the same with speculation on and off."""

import subprocess
import sys

import pytest

import pagelm
from pagelm.errors import PagelmError
from pagelm.quant import int8dot
from rows_check import PROMPT, verify_and_rewind


def _synth(path, shape, *extra):
    subprocess.run([sys.executable, "-m", "pagelm", "synth", "--shape", shape, "--quiet", *extra, str(path)],
                   check=True, capture_output=True)
    return str(path)


@pytest.fixture(scope="module")
def qwen_tiny(tmp_path_factory):
    return _synth(tmp_path_factory.mktemp("m") / "qwen3.5-tiny-gqa.gguf", "qwen3.5-tiny-gqa", "--layer-type", "Q8_0")


WEIGHTS = [(w, d) for w in ("mapped", "dense") for d in ("float32", "bfloat16")] + [("mapped-int8", "bfloat16")]


def _load(path, weights, dtype):
    if weights == "mapped-int8" and not int8dot.available():
        pytest.skip("mapped-int8 needs AVX2")
    return pagelm.load(path, weights=weights, dtype=dtype)


@pytest.mark.parametrize("weights, dtype", WEIGHTS)
def test_qwen35_verify_pass_rows_and_rewinds_are_one_token_decodes(qwen_tiny, weights, dtype):
    model = _load(qwen_tiny, weights, dtype)
    verify_and_rewind(model)
    verify_and_rewind(model, position_delta=-3)


@pytest.mark.parametrize("weights, dtype", WEIGHTS)
@pytest.mark.parametrize("fixture", ["qwen2_tiny_gguf", "qwen3_tiny_gguf"])
def test_llama_family_verify_pass_rows_and_rewinds_are_one_token_decodes(request, fixture, weights, dtype):
    verify_and_rewind(_load(request.getfixturevalue(fixture), weights, dtype))


@pytest.mark.parametrize("weights, dtype", [("mapped", "float32"), ("mapped", "bfloat16"), ("dense", "bfloat16"),
                                            ("mapped-int8", "bfloat16")])
@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_real_models_verify_pass_rows_and_rewinds_are_one_token_decodes(request, fixture, weights, dtype):
    verify_and_rewind(_load(request.getfixturevalue(fixture), weights, dtype))


def test_a_verify_pass_at_the_context_end_and_bad_rewinds_are_refused(qwen_tiny):
    model = pagelm.load(qwen_tiny, dtype="float32")
    session = model.session(max_len=12)
    session.prefill(PROMPT)
    with pytest.raises(PagelmError, match="context overflow"):
        session.verify([1, 2, 3, 4, 5])
    with pytest.raises(PagelmError, match="no verify pass"):
        session.rewind(1)
    session.verify([1, 2, 3])
    with pytest.raises(PagelmError, match="rewind to 4 rows of a pass of 3"):
        session.rewind(4)
    session.rewind(2)
    with pytest.raises(PagelmError, match="rewind to 3 rows of a pass of 2"):
        session.rewind(3)
    session.decode(4)
    with pytest.raises(PagelmError, match="no verify pass"):
        session.rewind(1)
    assert session.tokens == PROMPT + [1, 2, 4]
