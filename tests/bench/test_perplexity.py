"""`pagelm bench perplexity`: the text, the NLL, and both paths on a tiny synthetic Qwen3.5."""

import math
import subprocess
import sys

import numpy as np
import pytest

from pagelm.bench.perplexity import default_text, next_token_nll, paired_ratio, run_perplexity, text_tokens


def test_default_text_is_pythons_documentation_in_topic_order():
    from pydoc_data.topics import topics

    text = default_text()
    first = sorted(topics)[0]
    assert text.startswith(topics[first]) and len(text) > 100_000
    assert text == default_text()


def test_next_token_nll_is_float64_log_softmax():
    torch = pytest.importorskip("torch")
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 30
    expected = -torch.log_softmax(torch.from_numpy(logits).double(), 0)[123].item()
    assert next_token_nll(logits, 123) == pytest.approx(expected, rel=1e-12)
    assert next_token_nll(np.zeros(8, np.float32), 3) == pytest.approx(math.log(8))


def test_text_tokens_takes_the_first_n():
    class Words:  # one token per word; encode of a prefix is the prefix of the ids
        def encode(self, text, add_special=False):
            return [len(w) for w in text.split()]

    text = " ".join(str(i) for i in range(5000))
    assert text_tokens(Words(), text, 100) == [len(str(i)) for i in range(100)]
    assert len(text_tokens(Words(), "a b c", 100)) == 3


def test_perplexity_on_a_tiny_qwen35(qwen35_chat_gguf):
    pytest.importorskip("torch")
    report = run_perplexity("qwen3.5-tiny-chat", qwen35_chat_gguf, tokens=48, weights=("mapped", "dense"),
                            dtypes=("float32", "bfloat16"), progress=False, command="pagelm bench perplexity x")
    assert [(r.weights, r.dtype, r.tokens) for r in report.rows] == [
        ("mapped", "float32", 48), ("mapped", "bfloat16", 48), ("dense", "float32", 48), ("dense", "bfloat16", 48)]
    for r in report.rows:
        assert math.isfinite(r.prefill) and math.isfinite(r.decode) and r.prefill > 1 and r.decode > 1
    for mode in ("mapped", "dense"):
        # the same mean NLL by two paths (the random model's perplexity is huge: compare logs)
        r = report.row(mode, "float32")
        assert math.log(r.prefill) == pytest.approx(math.log(r.decode), rel=1e-3)
    text = report.markdown()
    lines = text.splitlines()
    assert lines[0] == "| model | weights | dtype | tokens | ppl prefill | ppl decode |"
    assert sum(line.startswith("| qwen3.5-tiny-chat | ") for line in lines) == 4
    assert ("| dtype | mapped/dense − 1, prefill | mapped/dense − 1, decode | standard error, prefill | "
            "standard error, decode |") in lines
    float32 = next(line for line in lines if line.startswith("| float32 | ")).strip("| ").split(" | ")
    mapped, dense = report.row("mapped", "float32"), report.row("dense", "float32")
    assert float32[2] == f"{(mapped.decode / dense.decode - 1) * 100:+.3f}%"
    assert float32[4].endswith("%") and float(float32[4][:-1]) >= 0
    assert lines[-1] == "Command: `pagelm bench perplexity x`"


def test_paired_ratio_is_the_perplexity_ratio_with_the_standard_error_of_its_log():
    rng = np.random.default_rng(1)
    reference = rng.exponential(2.5, 4001)
    nll = reference + rng.normal(0.002, 0.05, reference.size)
    ratio, se = paired_ratio(nll, reference)
    assert ratio == pytest.approx((math.exp(nll.mean()) / math.exp(reference.mean()) - 1) * 100, rel=1e-9)
    assert se == pytest.approx(0.05 / math.sqrt(reference.size) * 100, rel=0.05)
    assert paired_ratio(reference + 0.01, reference) == pytest.approx(((math.exp(0.01) - 1) * 100, 0.0), abs=1e-9)


def test_cli_rejects_unknown_modes(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pagelm", "bench", "perplexity", str(tmp_path / "none.gguf"),
                             "--weights", "mapped,packed"], capture_output=True, text=True)
    assert result.returncode != 0 and "packed" in result.stderr
