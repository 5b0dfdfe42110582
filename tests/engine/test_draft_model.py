"""Drafts from a second model of the same vocabulary: the answer and the session's state are the
plain ones whatever the draft model (a hybrid one, one whose state is all KV caches, the model
itself), greedy and seeded; its session follows the context through kept and rejected drafts
(taken back by `Session.back_to`), and a vocabulary of another size is refused by name."""

import numpy as np
import pytest

import pagelm
from pagelm.engine.sampling import SamplingParams
from pagelm.engine.speculate import DraftModel, Speculator
from pagelm.errors import PagelmError
from rows_check import PROMPT, same_state

GREEDY = SamplingParams(max_tokens=40)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=40)


def _answers(model, draft_model, params):
    prompt = [t % model.head.vocab_size for t in PROMPT]
    alone = model.session(max_len=96)
    plain = list(alone.generate(prompt, params))
    session = model.session(max_len=96)
    speculator = Speculator.of("lookup", DraftModel.of(draft_model, model.head.vocab_size, 96))
    got = list(session.generate(prompt, params, speculate=speculator))
    return plain, got, same_state(session, alone), speculator.stats


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("draft", ["qwen_tiny", "qwen3_tiny_gguf", "lfm2_tiny_gguf"])
def test_a_draft_model_never_changes_the_answer_or_the_state(request, qwen_tiny, draft, params):
    model = pagelm.load(qwen_tiny, dtype="bfloat16")
    draft_model = pagelm.load(request.getfixturevalue(draft), dtype="bfloat16")
    plain, got, same, stats = _answers(model, draft_model, params)
    assert got == plain and len(got) == 40 and same
    assert stats.drafted > 0 and stats.passes > 1


@pytest.mark.parametrize("fixture", ["qwen_tiny", "qwen3_tiny_gguf"])
def test_the_model_drafting_for_itself_has_its_greedy_drafts_kept(request, fixture):
    model = pagelm.load(request.getfixturevalue(fixture), dtype="float32")
    plain, got, same, stats = _answers(model, model, GREEDY)
    assert got == plain and same
    # its drafts are its own greedy tokens (from prefill's arithmetic for the tokens it catches up on,
    # decode's for the rest: an argmax may differ where two logits nearly tie)
    assert stats.accepted >= 0.9 * stats.drafted and stats.passes < len(plain) // 3, stats


@pytest.mark.parametrize("fixture", ["qwen_tiny", "qwen3_tiny_gguf"])
def test_the_draft_session_follows_the_context_through_kept_and_rejected_drafts(request, fixture):
    model = pagelm.load(request.getfixturevalue(fixture), dtype="float32")
    prompt = [t % model.head.vocab_size for t in PROMPT][:20]
    source = DraftModel.of(model, model.head.vocab_size, 96)
    drafts = source.draft(prompt, len(prompt), 5)
    assert len(drafts) == 5 and source.session.tokens == prompt + drafts[:4]
    # two drafts kept, then a token of the target's own: the session holds the context, then drafts on
    context = prompt + drafts[:2] + [(drafts[2] + 1) % model.head.vocab_size]
    more = source.draft(context, len(prompt), 3)
    fresh = model.session(96)
    fresh.prefill(context)
    assert source.session.tokens == context + more[:2]
    assert more[0] == int(np.argmax(fresh.logits))
    # another context altogether: drafted from the start
    other = prompt[::-1]
    assert source.draft(other, len(other), 2)[0] == int(np.argmax(model.session(96).prefill(other)))


def test_a_draft_model_of_another_vocabulary_size_is_refused(qwen_tiny, smollm2_gguf):
    model = pagelm.load(qwen_tiny)
    with pytest.raises(PagelmError, match="49152 tokens in its vocabulary, the model 4096"):
        DraftModel.of(pagelm.load(smollm2_gguf), model.head.vocab_size, 96)
