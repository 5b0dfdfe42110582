"""Sampler arithmetic against direct computations on small logit vectors."""

from collections import Counter

import numpy as np
import pytest

from pagelm.errors import PagelmError
from pagelm.engine.sampling import Sampler, SamplingParams


def _draws(params, logits, n=4000, seen=None):
    sampler = Sampler(params)
    return Counter(sampler.sample(logits, position, seen) for position in range(n))


LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03], np.float32))


def test_greedy_is_argmax_and_ignores_seed():
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert Sampler(SamplingParams()).sample(logits, 0) == int(np.argmax(logits))
    assert Sampler(SamplingParams(temperature=0.7, top_k=1, seed=3)).sample(logits, 0) == int(np.argmax(logits))


def test_temperature_one_follows_the_softmax():
    counts = _draws(SamplingParams(temperature=1.0, seed=0), LOGITS, n=20000)
    freq = np.array([counts[i] for i in range(5)]) / 20000
    assert np.allclose(freq, [0.5, 0.25, 0.15, 0.07, 0.03], atol=0.015)


def test_top_k_top_p_min_p_limit_the_candidates():
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2, seed=1), LOGITS)) == {0, 1}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.7, seed=1), LOGITS)) == {0, 1}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.76, seed=1), LOGITS)) == {0, 1, 2}
    assert set(_draws(SamplingParams(temperature=1.0, min_p=0.25, seed=1), LOGITS)) == {0, 1, 2}


def test_top_p_over_a_large_flat_vocabulary_falls_back_to_a_full_sort():
    logits = np.zeros(5000, np.float32)  # 1,024 candidates hold only ~20 % of the mass
    counts = _draws(SamplingParams(temperature=1.0, top_p=0.5, seed=2), logits, n=3000)
    assert max(counts) >= 1024 and len(counts) > 1500


def test_seed_repeats_and_differs():
    logits = np.random.default_rng(5).standard_normal(500).astype(np.float32)

    def run(seed):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler.sample(logits, position) for position in range(30)]

    assert run(7) == run(7) and run(7) != run(8)


def test_a_draw_depends_on_the_seed_and_the_position_alone():
    """What speculative decoding needs: the token at a position comes out the same whatever was
    drawn before it, in whatever order the positions are asked."""
    logits = np.random.default_rng(6).standard_normal(500).astype(np.float32)
    params = SamplingParams(temperature=1.0, seed=11)
    in_order = [Sampler(params).sample(logits, position) for position in range(40)]
    shuffled = Sampler(params)
    order = np.random.default_rng(0).permutation(40)
    assert {int(p): shuffled.sample(logits, int(p)) for p in order} == dict(enumerate(in_order))
    assert len(set(in_order)) > 10  # the positions draw differently
    assert Sampler(SamplingParams(temperature=1.0, seed=-3)).uniform(5) == Sampler(
        SamplingParams(temperature=1.0, seed=2**64 - 3)).uniform(5)  # any integer seed is taken modulo 2^64


def test_penalties_follow_their_definitions():
    logits = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    seen = Counter({0: 3, 1: 1})
    rep = Sampler(SamplingParams(repetition_penalty=2.0)).penalize(logits, seen)
    assert np.allclose(rep, [1.0, -4.0, 1.0, 0.5])
    freq = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)).penalize(logits, seen)
    assert np.allclose(freq, [2.0 - 0.5 - 0.75, -2.0 - 0.5 - 0.25, 1.0, 0.5])
    assert Sampler(SamplingParams(repetition_penalty=4.0)).sample(logits, 0, seen) == 2
    assert np.array_equal(logits, [2.0, -2.0, 1.0, 0.5])  # the caller's logits are untouched


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2),
                                 dict(top_k=-1), dict(repetition_penalty=0), dict(max_tokens=-1)])
def test_bad_parameters_are_named(bad):
    with pytest.raises(PagelmError, match=next(iter(bad))):
        SamplingParams(**bad)
