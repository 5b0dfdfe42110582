"""The prefix cache over real engine sessions: exact restores for the hybrid Qwen3.5 state and a
plain KV state, longest-prefix lookup, shared K/V segments, LRU within slots and bytes."""

import numpy as np
import pytest

import pagelm
from pagelm.serve.prefix_cache import PrefixCache

PROMPT = list(range(1000, 1090))


@pytest.fixture(scope="module")
def qwen(qwen35_chat_gguf):
    return pagelm.load(qwen35_chat_gguf, dtype="float32")


@pytest.fixture(scope="module")
def smollm(smollm2_gguf):
    return pagelm.load(smollm2_gguf, dtype="float32")


def prefill_in(session, tokens, splits):
    cursor = 0
    for point in [*splits, len(tokens)]:
        logits = session.prefill(tokens[cursor:point])
        cursor = point
    return logits


@pytest.mark.parametrize("which", ["qwen", "smollm"])
def test_restore_continues_exactly_like_the_uninterrupted_session(which, request):
    model = request.getfixturevalue(which)
    cache = PrefixCache(slots=8, max_bytes=1 << 30)
    first = model.session(256)
    prefill_in(first, PROMPT[:40], [])
    stored = cache.store(first)
    first.prefill(PROMPT[40:])
    expected = [first.decode(t).copy() for t in (5, 6, 7)]

    other = model.session(256)
    other.prefill(list(range(2000, 2100)))  # dirty state: restore must overwrite all of it
    hit = cache.lookup(PROMPT)
    assert hit is stored and len(hit.tokens) == 40
    cache.restore(hit, other)
    assert other.tokens == PROMPT[:40]
    other.prefill(PROMPT[40:])
    got = [other.decode(t).copy() for t in (5, 6, 7)]
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(e, g)


def test_lookup_takes_the_longest_proper_prefix(qwen):
    cache = PrefixCache(slots=8, max_bytes=1 << 30)
    session = qwen.session(256)
    base = None
    for point in (10, 30, 50):
        session.prefill(PROMPT[len(session.tokens):point])
        base = cache.store(session, base)
    assert len(cache.lookup(PROMPT[:60]).tokens) == 50
    assert len(cache.lookup(PROMPT[:50]).tokens) == 30  # an exact match leaves no token to prefill
    assert len(cache.lookup(PROMPT[:31]).tokens) == 30
    assert cache.lookup(PROMPT[1:40]) is None
    assert cache.lookup([7]) is None
    assert (cache.lookups, cache.hits, cache.tokens_reused) == (5, 3, 110)


def test_longest_may_take_all_the_tokens_and_is_not_counted(qwen):
    cache = PrefixCache(slots=8, max_bytes=1 << 30)
    session = qwen.session(256)
    session.prefill(PROMPT[:20])
    cache.store(session)
    session.prefill(PROMPT[20:50])
    whole = cache.store(session)
    assert cache.longest(PROMPT[:50]) is whole
    assert len(cache.longest(PROMPT[:49]).tokens) == 20
    assert cache.longest(PROMPT[1:50]) is None
    assert (cache.lookups, cache.hits, cache.tokens_reused) == (0, 0, 0)


def test_checkpoints_of_one_request_share_their_kv_segments(qwen):
    cache = PrefixCache(slots=8, max_bytes=1 << 30)
    session = qwen.session(256)
    session.prefill(PROMPT[:20])
    a = cache.store(session)
    session.prefill(PROMPT[20:60])
    b = cache.store(session, a)
    assert b.segments[0] is a.segments[0]
    assert [(s.start, s.end) for s in b.segments] == [(0, 20), (20, 60)]
    per_token = a.segments[0].nbytes // 20
    assert cache.bytes_held == 60 * per_token + a.fixed_nbytes + b.fixed_nbytes
    # a base that is not a prefix of the session is ignored: the whole K/V is copied
    other = qwen.session(256)
    other.prefill(list(range(3000, 3030)))
    c = cache.store(other, a)
    assert [(s.start, s.end) for s in c.segments] == [(0, 30)]


def test_a_whole_prompt_checkpoint_serves_only_that_prompt_again(qwen):
    cache = PrefixCache(slots=8, max_bytes=1 << 30)
    session = qwen.session(256)
    session.prefill(PROMPT[:30])
    boundary = cache.store(session)
    logits = session.prefill(PROMPT[30:50]).copy()
    whole = cache.store(session, boundary, whole=True)
    assert whole.logits is not None and whole.fixed_nbytes == boundary.fixed_nbytes + logits.nbytes
    assert cache.lookup(PROMPT[:50]) is whole  # nothing left to prefill
    other = qwen.session(256)
    cache.restore(whole, other)
    np.testing.assert_array_equal(other.logits, logits)
    np.testing.assert_array_equal(other.decode(5), session.decode(5))
    # never a prefix: a longer prompt would be cut where no other request cuts it
    assert cache.lookup(PROMPT[:60]) is boundary
    assert cache.longest(PROMPT[:60]) is boundary
    # a prefix checkpoint of the same tokens takes its place, and is kept over a later whole one
    replay = qwen.session(256)
    prefill_in(replay, PROMPT[:50], [30])
    prefix = cache.store(replay, boundary)
    assert prefix is not whole and prefix.logits is None and len(cache) == 2
    assert cache.store(replay, boundary, whole=True) is prefix
    assert cache.lookup(PROMPT[:50]) is boundary


def test_storing_the_same_tokens_again_only_touches_the_entry(qwen):
    cache = PrefixCache(slots=8, max_bytes=1 << 30)
    session = qwen.session(256)
    session.prefill(PROMPT[:20])
    a = cache.store(session)
    assert cache.store(session) is a and len(cache) == 1


def test_lru_eviction_by_slots_and_by_bytes(qwen):
    session = qwen.session(256)
    cache = PrefixCache(slots=2, max_bytes=1 << 30)
    entries = []
    for start in (0, 100, 200):
        session.reset()
        session.prefill(list(range(start, start + 10)))
        entries.append(cache.store(session))
    assert len(cache) == 2 and cache.evictions == 1
    assert cache.lookup(list(range(0, 11))) is None  # the oldest went first
    assert cache.lookup(list(range(100, 111))) is entries[1]

    one = entries[0].fixed_nbytes + entries[0].segments[0].nbytes
    small = PrefixCache(slots=100, max_bytes=2 * one)
    for start in (0, 100, 200):
        session.reset()
        session.prefill(list(range(start, start + 10)))
        small.store(session)
    assert len(small) == 2 and small.bytes_held <= 2 * one
    assert PrefixCache(slots=100, max_bytes=one - 1).store(session) is None  # too big alone


def test_a_disabled_cache_stores_and_finds_nothing(qwen):
    session = qwen.session(64)
    session.prefill(PROMPT[:10])
    for cache in (PrefixCache(0, 1 << 30), PrefixCache(8, 0)):
        assert cache.store(session) is None
        assert cache.lookup(PROMPT) is None
        assert cache.stats()["lookups"] == 0


def test_reset_matches_a_fresh_session(qwen):
    fresh = qwen.session(128).prefill(PROMPT[:30])
    session = qwen.session(128)
    session.prefill(PROMPT[30:70])
    session.reset()
    np.testing.assert_array_equal(session.prefill(PROMPT[:30]), fresh)
