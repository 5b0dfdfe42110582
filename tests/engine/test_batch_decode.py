"""Batched decode: every session gets from a batched step the bits it gets decoding alone, on every
architecture, both weights modes and both dtypes; sessions at different lengths, restored from
checkpoints, after images (their rope offset), joining and leaving; seeded sampling alike."""

import dataclasses

import numpy as np
import pytest

import pagelm
from pagelm.engine.batch import MAX_BATCH, Request, generate_batch
from pagelm.errors import PagelmError
from pagelm.quant import int8dot
from pagelm.engine.sampling import SamplingParams

PROMPTS = [[11, 400, 7, 3000, 12], [5, 9, 33, 2, 1000, 17, 250, 8, 44, 61, 90, 3], [77], [300, 301, 302, 303, 4, 5, 6]]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


class Pair:
    """One sequence twice: a session that decodes in batches and one that decodes alone."""

    def __init__(self, model, prompt, checkpoint=None):
        self.batched, self.alone = model.session(max_len=64), model.session(max_len=64)
        for s in (self.batched, self.alone):
            if checkpoint is None:
                s.prefill(prompt)
            else:
                s.restore(checkpoint)

    def next_token(self) -> int:
        return int(np.argmax(self.alone.logits))


def step(model, pairs: list[Pair]) -> None:
    tokens = [p.next_token() for p in pairs]
    logits = model.decode_batch([p.batched for p in pairs], tokens)
    assert logits.shape == (len(pairs), model.head.vocab_size)
    for p, token, row in zip(pairs, tokens, logits):
        alone = p.alone.decode(token)
        assert same_bits(row, alone), f"{np.sum(row != alone)} logits differ"
        assert same_bits(p.batched.logits, alone)
        assert p.batched.tokens == p.alone.tokens and p.batched.position_delta == p.alone.position_delta


def joining_and_leaving(model, offset_rope: bool) -> None:
    a, b = Pair(model, PROMPTS[0]), Pair(model, PROMPTS[1])
    for _ in range(2):
        step(model, [a, b])
    source = model.session(max_len=64)
    source.prefill(PROMPTS[3])
    checkpoint = source.checkpoint()
    if offset_rope:  # as after an image: rope positions behind the token count (multimodal rope)
        checkpoint = dataclasses.replace(checkpoint, position_delta=-3)
    c = Pair(model, None, checkpoint)  # restored from a checkpoint, joining
    step(model, [a, b, c])
    d = Pair(model, PROMPTS[2])
    step(model, [c, d, b])  # a leaves, d joins, in another order
    step(model, [d])
    step(model, [a, d, c, b])


@pytest.mark.parametrize("weights, dtype", [(w, d) for w in ("mapped", "dense") for d in ("float32", "bfloat16")]
                         + [("mapped-int8", "bfloat16")])
def test_qwen35_batched_steps_are_each_sessions_own_bits(qwen_tiny, weights, dtype):
    if weights == "mapped-int8" and not int8dot.available():
        pytest.skip("mapped-int8 needs AVX2")
    joining_and_leaving(pagelm.load(qwen_tiny, weights=weights, dtype=dtype), offset_rope=True)


def test_qwen35_k_quant_mix_batched_steps_are_each_sessions_own_bits(qwen_tiny_k):
    joining_and_leaving(pagelm.load(qwen_tiny_k, dtype="bfloat16"), offset_rope=True)


@pytest.mark.parametrize("weights, dtype", [("mapped", "float32"), ("mapped", "bfloat16"), ("dense", "bfloat16")])
def test_qwen35moe_batched_steps_are_each_sessions_own_bits(qwen_moe_tiny, weights, dtype):
    joining_and_leaving(pagelm.load(qwen_moe_tiny, weights=weights, dtype=dtype), offset_rope=True)


@pytest.mark.parametrize("weights", ["mapped", "dense"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf", "qwen2_tiny_gguf", "qwen3_tiny_gguf",
                                     "qwen3moe_tiny_gguf", "gpt_oss_tiny_gguf"])
def test_llama_and_gemma3_batched_steps_are_each_sessions_own_bits(request, fixture, weights, dtype):
    joining_and_leaving(pagelm.load(request.getfixturevalue(fixture), weights=weights, dtype=dtype),
                        offset_rope=False)


# the mixtures of experts: up to MAX_BATCH rows an expert
@pytest.mark.parametrize("fixture", ["qwen_tiny", "qwen3moe_tiny_gguf", "qwen_moe_tiny", "gpt_oss_tiny_gguf"])
def test_a_full_batch_of_sessions_at_different_lengths(request, fixture):
    model = pagelm.load(request.getfixturevalue(fixture), dtype="float32")
    pairs = [Pair(model, PROMPTS[i % 4][: 1 + i % 5] + [i]) for i in range(MAX_BATCH)]
    step(model, pairs)
    step(model, pairs[::-1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_a_full_batch_of_real_sessions(request, fixture, dtype):
    """SmolLM2's 9 heads: 8 sequences make 72 q rows, more than one token's kernel row limit."""
    model = pagelm.load(request.getfixturevalue(fixture), dtype=dtype)
    pairs = [Pair(model, PROMPTS[i % 4][: 1 + i % 5] + [i]) for i in range(MAX_BATCH)]
    step(model, pairs)
    step(model, pairs[::-1])


def test_seeded_sampling_is_the_same_alone_and_batched(qwen_tiny):
    model = pagelm.load(qwen_tiny, dtype="bfloat16")
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=1, max_tokens=12),
              SamplingParams(temperature=1.3, top_k=40, repetition_penalty=1.2, seed=7, max_tokens=5),
              SamplingParams(temperature=0.7, presence_penalty=0.5, seed=3, max_tokens=9),
              SamplingParams(max_tokens=7)]
    alone = []
    for prompt, p in zip(PROMPTS, params):
        session = model.session(max_len=64)
        alone.append((list(session.generate(prompt, p)), session.tokens))
    sessions = [model.session(max_len=64) for _ in PROMPTS]
    got = generate_batch([Request(s, prompt, p) for s, prompt, p in zip(sessions, PROMPTS, params)])
    assert got == [tokens for tokens, _ in alone]
    assert [s.tokens for s in sessions] == [tokens for _, tokens in alone]
    assert [len(g) for g in got] == [12, 5, 9, 7]


def test_bad_batches_are_refused_with_a_clear_error(qwen_tiny):
    model = pagelm.load(qwen_tiny, dtype="float32")
    a, b = model.session(max_len=8), model.session(max_len=8)
    a.prefill([1, 2, 3])
    b.prefill([4, 5, 6, 7, 8, 9, 10, 11])
    with pytest.raises(PagelmError, match="one token each"):
        model.decode_batch([a], [1, 2])
    with pytest.raises(PagelmError, match="twice"):
        model.decode_batch([a, a], [1, 2])
    with pytest.raises(PagelmError, match="context overflow"):
        model.decode_batch([a, b], [1, 2])
    with pytest.raises(PagelmError, match=f"1 to {MAX_BATCH}"):
        model.decode_batch([], [])
    other = pagelm.load(qwen_tiny, dtype="float32").session(max_len=8)
    with pytest.raises(PagelmError, match="this model"):
        model.decode_batch([a, other], [1, 2])
    assert a.tokens == [1, 2, 3]  # nothing was fed


def test_session_state_bytes_are_its_state_and_logits(qwen_tiny):
    model = pagelm.load(qwen_tiny, dtype="float32")
    session = model.session(max_len=64)
    empty = session.nbytes
    assert empty == session.state.nbytes > 0
    session.prefill([1, 2])
    assert session.nbytes == session.state.nbytes + model.head.vocab_size * 4
    assert session.state.nbytes >= empty  # the KV pages of the positions written join it


@pytest.mark.parametrize("fixture", ["qwen_tiny", "smollm2_gguf", "gemma3_gguf"])
def test_a_prefill_paused_between_layers_while_others_decode_gets_its_own_bits(request, fixture):
    """What a server does with a long prompt while other streams run: between two layers of its
    prefill, another session decodes; the prompt's logits and what follows are bit for bit alone's."""
    model = pagelm.load(request.getfixturevalue(fixture), dtype="bfloat16")
    other = Pair(model, PROMPTS[0])
    prompt = PROMPTS[1] + PROMPTS[3]
    alone, paused = model.session(max_len=64), model.session(max_len=64)
    want = alone.prefill(prompt)
    steps, layers = paused.prefill_layers(prompt), 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            got = done.value
            break
        layers += 1
        step(model, [other])
    assert layers == len(model.network.layers)
    assert same_bits(got, want) and paused.tokens == alone.tokens
    assert same_bits(paused.decode(7), alone.decode(7))


def test_a_prefill_dropped_half_way_leaves_nothing_behind_a_reset_or_restore(qwen_tiny):
    """A request cancelled in the middle of a prefill: its session, reset or restored, computes as new."""
    model = pagelm.load(qwen_tiny, dtype="bfloat16")
    fresh = model.session(max_len=64)
    want = fresh.prefill(PROMPTS[1])
    checkpoint = fresh.checkpoint()
    want_next = fresh.decode(9)
    session = model.session(max_len=64)
    for recover in (session.reset, lambda: session.restore(checkpoint)):
        steps = session.prefill_layers(PROMPTS[3])
        next(steps), next(steps)
        del steps
        recover()
        if not session.tokens:
            assert same_bits(session.prefill(PROMPTS[1]), want)
        assert same_bits(session.decode(9), want_next)


@pytest.mark.parametrize("weights, dtype", [("mapped", "bfloat16"), ("dense", "float32")])
@pytest.mark.parametrize("fixture, module", [("smollm2_gguf", "llama_family"), ("gemma3_gguf", "gemma3"),
                                             ("qwen2_tiny_gguf", "llama_family"), ("qwen3_tiny_gguf", "llama_family"),
                                             ("lfm2_tiny_gguf", "lfm2"), ("qwen3moe_tiny_gguf", "llama_family")])
def test_the_token_step_in_numpy_gives_the_torch_layers_bits(request, monkeypatch, fixture, module, weights, dtype):
    """The one-token step in numpy between the kernels (token_ops.TokenStep) against the torch
    layers it stands in for, which take every step where TokenStep.of refuses it; the layers as
    compiled calls (token_layers.TokenLayers, where every product is GGML rows in place) against both."""
    import importlib

    arch = importlib.import_module(f"pagelm.models.{module}")
    model = pagelm.load(request.getfixturevalue(fixture), weights=weights, dtype=dtype)

    def run() -> list[np.ndarray]:
        sessions = [model.session(max_len=32) for _ in range(3)]
        logits = np.stack([s.prefill(p) for s, p in zip(sessions, PROMPTS)])
        out = []
        for _ in range(3):
            logits = model.decode_batch(sessions, [int(np.argmax(row)) for row in logits])
            logits[0] = sessions[0].decode(int(np.argmax(logits[0])))
            out.append(logits.copy())
        return out

    made = []
    of = arch.TokenStep.of
    monkeypatch.setattr(arch.TokenStep, "of", lambda *a: made.append(of(*a)) or made[-1])
    numpy_steps = run()
    assert len(made) >= 6 and all(step is not None for step in made)  # every decode step took it
    moe = fixture == "qwen3moe_tiny_gguf"  # its experts are not compiled layers
    assert bool(model.network._compiled) == (weights == "mapped" and not moe)
    model.network._compiled = False  # the numpy step's own layers
    assert all(same_bits(a, b) for a, b in zip(run(), numpy_steps))
    monkeypatch.setattr(arch.TokenStep, "of", lambda *a: None)
    torch_steps = run()
    assert all(same_bits(a, b) for a, b in zip(numpy_steps, torch_steps))
