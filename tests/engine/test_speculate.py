"""Speculative decoding's foundation: a verify pass over several tokens of one sequence gives each
position the bits decoding it alone gives, on every architecture, weights mode and dtype; rewinding
a pass leaves exactly the state decoding only the kept tokens leaves; and answers, greedy and
seeded, are the same with speculation on and off."""

import dataclasses
import time

import numpy as np
import pytest

import pagelm
from pagelm.engine.sampling import SamplingParams
from pagelm.engine.speculate import FirstOf, Prediction, PromptLookup, Speculator, StepCosts
from pagelm.errors import PagelmError
from pagelm.quant import int8dot
from rows_check import PROMPT, same_state, verify_and_rewind, verify_together


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
    verify_together(model)


@pytest.mark.parametrize("weights, dtype", [("mapped", "float32"), ("mapped", "bfloat16"), ("dense", "bfloat16")])
def test_qwen35moe_verify_pass_rows_and_rewinds_are_one_token_decodes(qwen_moe_tiny, weights, dtype):
    """A pass's rows go to their own experts, each row's product its own, as decoding it alone."""
    model = _load(qwen_moe_tiny, weights, dtype)
    verify_and_rewind(model)
    verify_together(model)


@pytest.mark.parametrize("weights, dtype", WEIGHTS)
@pytest.mark.parametrize("fixture", ["qwen2_tiny_gguf", "qwen3_tiny_gguf"])
def test_llama_family_verify_pass_rows_and_rewinds_are_one_token_decodes(request, fixture, weights, dtype):
    model = _load(request.getfixturevalue(fixture), weights, dtype)
    verify_and_rewind(model)
    verify_together(model)


@pytest.mark.parametrize("weights, dtype", [("mapped", "float32"), ("mapped", "bfloat16"), ("dense", "bfloat16"),
                                            ("mapped-int8", "bfloat16")])
@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_real_models_verify_pass_rows_and_rewinds_are_one_token_decodes(request, fixture, weights, dtype):
    model = _load(request.getfixturevalue(fixture), weights, dtype)
    verify_and_rewind(model)
    verify_together(model)


def test_a_verify_pass_at_the_context_end_and_bad_rewinds_are_refused(qwen_tiny):
    model = pagelm.load(qwen_tiny, dtype="float32")
    session = model.session(max_len=14)
    session.prefill(PROMPT)
    with pytest.raises(PagelmError, match="context overflow"):
        session.verify([1, 2, 3, 4, 5, 6, 7])
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
    session.verify([5])
    model.decode_batch([session], [6])
    with pytest.raises(PagelmError, match="no verify pass"):
        session.rewind(1)
    other = model.session(max_len=14)
    for bad in ([session, session], [session, pagelm.load(qwen_tiny).session(8)]):
        with pytest.raises(PagelmError):
            model.verify_batch(bad, [[1], [2]])
    with pytest.raises(PagelmError, match="at most 16 in all"):
        model.verify_batch([other, model.session(64)], [[1], list(range(16))])
    with pytest.raises(PagelmError, match="each at least one row"):
        model.verify_batch([other, model.session(8)], [[1], []])
    assert other.tokens == []
    assert session.tokens == PROMPT + [1, 2, 4, 5, 6]


class Oracle:
    """Drafts the answer a plain run gave (known in advance), every `wrong`-th of its tokens changed:
    verify passes that keep every draft, some and none, on any model, whatever it generates."""

    def __init__(self, answer: list[int], vocab: int, wrong: int = 4):
        self.answer, self.vocab, self.wrong = answer, vocab, wrong

    def draft(self, context, start: int, limit: int) -> list[int]:
        at = len(context) - start
        return [(t + 1) % self.vocab if (at + i) % self.wrong == self.wrong - 1 else t
                for i, t in enumerate(self.answer[at : at + limit])]


class NoMultiplesOf3:
    """A constraint (as a grammar's matcher is one): forbids token ids divisible by 3, records the
    tokens it is told were chosen."""

    def __init__(self):
        self.accepted = []

    def mask(self, logits):
        logits[::3] = -np.inf
        return logits

    def accept(self, token):
        self.accepted.append(token)


def _plain_and_speculative(model, prompt, params, source=None, constraints=(None, None), stop_after=None):
    """(plain tokens, plain session, speculative tokens, its session, its speculator); with
    `stop_after`, each generation is closed after that many tokens (a caller that stops reading)."""
    runs = []
    for speculate, constraint in zip(("off", "spec"), constraints):
        session = model.session(max_len=96)
        speculator = Speculator(source(session) if source else None) if speculate == "spec" else None
        tokens = session.generate(prompt, params, constraint=constraint, speculate=speculator or "off")
        got = list(tokens) if stop_after is None else [t for _, t in zip(range(stop_after), tokens)]
        tokens.close()
        runs += [got, session]
    return (*runs, speculator)


SAMPLINGS = [SamplingParams(max_tokens=40),
             SamplingParams(temperature=0.8, top_p=0.9, seed=5, repetition_penalty=1.3, max_tokens=40),
             SamplingParams(temperature=1.2, top_k=50, presence_penalty=0.5, seed=11, max_tokens=40)]


@pytest.mark.parametrize("params", SAMPLINGS)
def test_drafts_right_and_wrong_give_the_plain_answer_and_state(qwen_tiny, params):
    model = pagelm.load(qwen_tiny, dtype="bfloat16")
    prompt = [t % model.head.vocab_size for t in PROMPT]
    plain = list(model.session(max_len=96).generate(prompt, params))
    oracle = lambda _: Oracle(plain, model.head.vocab_size)  # noqa: E731
    want, alone, got, spec, speculator = _plain_and_speculative(model, prompt, params, oracle)
    assert got == want == plain and len(got) == 40
    assert same_state(spec, alone)
    s = speculator.stats
    assert s.accepted > 0 and s.drafted > s.accepted and s.passes > 1
    # a caller that stops reading anywhere leaves the session where plain decoding leaves it
    for stop_after in (1, 2, 3, 5, 8, 13, 21):
        want, alone, got, spec, _ = _plain_and_speculative(model, prompt, params, oracle, stop_after=stop_after)
        assert got == want == plain[:stop_after] and same_state(spec, alone), f"stopped after {stop_after}"


def test_stop_tokens_max_tokens_and_constraints_apply_per_position(qwen_tiny):
    model = pagelm.load(qwen_tiny, dtype="float32")
    prompt = [t % model.head.vocab_size for t in PROMPT]
    params = SamplingParams(temperature=0.9, seed=2, max_tokens=30)
    plain = list(model.session(max_len=96).generate(prompt, params))
    oracle = lambda _: Oracle(plain, model.head.vocab_size, wrong=6)  # noqa: E731
    stop = plain[17]
    stopped = dataclasses.replace(params, stop_tokens=(stop,))
    want, alone, got, spec, _ = _plain_and_speculative(model, prompt, stopped, oracle)
    assert got == want == plain[: plain.index(stop) + 1] and same_state(spec, alone)
    for max_tokens in (0, 1, 2, 9):
        short = dataclasses.replace(params, max_tokens=max_tokens)
        want, alone, got, spec, _ = _plain_and_speculative(model, prompt, short, oracle)
        assert got == want == plain[:max_tokens] and same_state(spec, alone)
    constraints = NoMultiplesOf3(), NoMultiplesOf3()
    masked = list(model.session(max_len=96).generate(prompt, params, constraint=NoMultiplesOf3()))
    oracle = lambda _: Oracle(masked, model.head.vocab_size, wrong=5)  # noqa: E731
    want, alone, got, spec, speculator = _plain_and_speculative(model, prompt, params, oracle, constraints)
    assert got == want == masked and all(t % 3 for t in got) and same_state(spec, alone)
    assert constraints[0].accepted == constraints[1].accepted == got and speculator.stats.accepted > 0


def test_the_context_end_ends_a_speculative_answer_where_it_ends_a_plain_one(qwen_tiny):
    model = pagelm.load(qwen_tiny, dtype="float32")
    prompt = [t % model.head.vocab_size for t in PROMPT]
    params = SamplingParams(max_tokens=100)
    answers = []
    for speculate in ("off", Speculator(Oracle([7] * 100, model.head.vocab_size, wrong=1000))):
        session = model.session(max_len=len(prompt) + 11)
        answers.append((list(session.generate(prompt, params, speculate=speculate)), session.tokens))
    assert answers[0] == answers[1] and len(answers[0][0]) == 12


@pytest.mark.parametrize("params, accepted", [(SamplingParams(max_tokens=24), 12),
                                               (SamplingParams(temperature=0.7, seed=3, max_tokens=24), 1)])
def test_prompt_lookup_on_a_text_that_repeats_gives_the_plain_answer(smollm2_chat, params, accepted):
    model, text = smollm2_chat.model, "Roses are red, violets are blue, sugar is sweet, and so are you.\n"
    prompt = smollm2_chat.tokenizer.encode(text * 3 + "Roses are")
    want, alone, got, spec, speculator = _plain_and_speculative(model, prompt, params, lambda _: PromptLookup())
    assert got == want and (len(got) == 24 or got[-1] in model.eos_tokens) and same_state(spec, alone)
    assert speculator.stats.accepted >= accepted, speculator.stats


def test_prompt_lookup_drafts_what_followed_the_longest_latest_n_gram():
    lookup = PromptLookup(longest=3, shortest=2)
    assert lookup.draft([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4], 0, 3) == [6, 7, 2]  # 3-gram, latest
    assert lookup.draft([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4], 0, 1) == [6]
    assert lookup.draft([5, 6, 7, 8, 1, 2, 3, 5, 6], 0, 4) == [7, 8, 1, 2]  # only a 2-gram
    assert lookup.draft([5, 6, 7, 8, 1, 2, 3, 6], 0, 4) == []  # a 1-gram is too short
    assert PromptLookup(shortest=1).draft([5, 6, 7, 8, 1, 2, 3, 6], 0, 2) == [7, 8]
    assert lookup.draft([4, 4, 4], 0, 5) == [4]  # the context's own tail continues itself
    assert lookup.draft([], 0, 3) == lookup.draft([1], 0, 3) == []
    with pytest.raises(PagelmError):
        PromptLookup(longest=1, shortest=2)


def test_a_prediction_drafts_its_start_then_follows_the_answer_through_edits():
    prediction = Prediction([10, 11, 12, 13, 10, 11, 14, 15, 16])
    prompt = [1, 2, 3]
    assert prediction.draft(prompt, 3, 4) == [10, 11, 12, 13]  # no answer yet: the prediction's start
    assert prediction.draft(prompt + [10, 11, 12], 3, 2) == [13, 10]
    # "10 11" comes twice: "13 10 11" is the second
    assert prediction.draft(prompt + [10, 11, 12, 13, 10, 11], 3, 3) == [14, 15, 16]
    assert prediction.draft(prompt + [10, 11, 12, 13, 10, 11, 99, 15], 3, 3) == [16]  # an edit: its 1-gram after
    assert prediction.draft(prompt + [10, 77, 2, 3], 3, 3) == [10, 77, 2]  # the prompt's "2 3", latest first
    assert Prediction([10, 11]).draft(prompt + [10, 77], 3, 3) == []
    assert Prediction([5, 6, 7]).draft([1, 5, 6], 1, 4) == [7]  # a draft from the prediction ends with it


@pytest.mark.parametrize("params", SAMPLINGS[:2])
def test_a_prediction_of_the_answer_is_all_accepted_and_an_edited_one_changes_nothing(qwen_tiny, params):
    model = pagelm.load(qwen_tiny, dtype="bfloat16")
    prompt = [t % model.head.vocab_size for t in PROMPT]
    plain = list(model.session(max_len=96).generate(prompt, params))
    want, alone, got, spec, speculator = _plain_and_speculative(model, prompt, params, lambda _: Prediction(plain))
    assert got == want == plain and same_state(spec, alone)
    s = speculator.stats
    # every token but the first came from a pass: a draft kept or the token after a pass's last draft
    assert s.accepted == s.drafted == len(plain) - 1 - s.passes and s.passes < len(plain) // 4, s
    edited = plain[:10] + [7, 8, 9] + plain[14:30] + plain[32:]
    want, alone, got, spec, speculator = _plain_and_speculative(model, prompt, params, lambda _: Prediction(edited))
    assert got == want == plain and same_state(spec, alone)
    assert speculator.stats.drafted > speculator.stats.accepted >= 25, speculator.stats


def test_the_draft_count_grows_while_drafts_are_kept_and_drafting_pauses_after_misses():
    class Endless:
        def draft(self, context, start, limit):
            return [1] * limit

    speculator = Speculator(Endless(), most=8, first=4)
    assert len(speculator.draft([0], 0, 20)) == 4
    speculator.record(4, 4)
    assert len(speculator.draft([0], 0, 20)) == 8 and len(speculator.draft([0], 0, 3)) == 3  # doubled
    speculator.record(8, 2)
    assert len(speculator.draft([0], 0, 20)) == 3
    pauses = []
    for _ in range(6):  # passes that keep nothing: 1, 2, 4, 8, 8, 8 steps without drafts
        speculator.record(3, 0)
        pauses.append(0)
        while not speculator.draft([0], 0, 20):
            pauses[-1] += 1
    assert pauses == [1, 2, 4, 8, 8, 8]
    speculator.record(1, 1)
    assert speculator.draft([0], 0, 20) and speculator.stats.passes == 9
    assert (speculator.stats.drafted, speculator.stats.accepted) == (4 + 8 + 6 * 3 + 1, 4 + 2 + 1)


def test_auto_drafts_only_what_the_measured_step_costs_say_pays():
    costs = StepCosts()
    assert costs.drafts_that_pay(0.1, 8) == 8  # nothing measured yet: no cap
    costs.observe(1, 0.010)
    costs.observe(5, 0.014)  # each further row: 1 ms, a tenth of a step
    assert costs.drafts_that_pay(0.9, 8) == 8 and 1 <= costs.drafts_that_pay(0.5, 8) < 8
    assert costs.drafts_that_pay(0.05, 8) == 0  # a draft kept 1 time in 20 pays for no row
    costs.observe(5, 0.050)
    assert costs.per_row > 0.001 and costs.drafts_that_pay(0.5, 8) < 3

    class Endless:
        def draft(self, context, start, limit):
            return [1] * limit

    speculator = Speculator(Endless(), most=8, costs=costs)
    speculator.observe(1, 0.010)
    speculator.observe(3, 0.040)  # rows as dear as steps: no draft pays
    assert speculator.draft([0], 0, 8) == [] and speculator.next == 1
    assert [speculator.draft([0], 0, 8) for _ in range(Speculator.MAX_PAUSE)] == [[]] * Speculator.MAX_PAUSE
    assert speculator.draft([0], 0, 8) == [1]  # then one draft probes whether the rate seen changed
    speculator.record(1, 0)
    assert speculator.rate < 0.5 and not any(speculator.draft([0], 0, 8) for _ in range(Speculator.MAX_PAUSE + 1))
    assert Speculator(Endless(), most=8).draft([0], 0, 8) == [1] * 4  # lookup: no cost model
    assert Speculator.of("auto").costs is not None and Speculator.of("lookup").costs is None


def test_auto_counts_what_each_draft_costs_its_source():
    """An MTP layer's draft costs a layer and the output head: the rows it pays for are fewer."""
    free, dear = StepCosts(), StepCosts()
    for costs in (free, dear):
        costs.observe(1, 0.010)
        costs.observe(5, 0.014)
    dear.observe_drafts(2, 0.008)  # 4 ms a draft, 0.4 of a step
    assert dear.per_draft == 0.004 and free.per_draft is None
    assert dear.drafts_that_pay(0.7, 8) < free.drafts_that_pay(0.7, 8)
    assert dear.drafts_that_pay(0.3, 8) == 0 < free.drafts_that_pay(0.3, 8)

    class Slow:
        def draft(self, context, start, limit):
            time.sleep(0.002)
            return [1] * limit

    speculator = Speculator(Slow(), most=4, costs=StepCosts())
    assert speculator.draft([0], 0, 8) == [1] * 4 and speculator.costs.per_draft >= 0.002 / 4


def test_first_of_drafts_from_the_first_source_that_has_any():
    class Fixed:
        def __init__(self, tokens):
            self.tokens, self.calls = tokens, 0

        def draft(self, context, start, limit):
            self.calls += 1
            return self.tokens[:limit]

    empty, some, never = Fixed([]), Fixed([5, 6, 7]), Fixed([9])
    assert FirstOf(empty, some, never).draft([1, 2], 0, 2) == [5, 6] and never.calls == 0
    assert FirstOf(empty).draft([1, 2], 0, 2) == []


def test_auto_probes_ever_less_often_while_its_probes_keep_nothing():
    class Endless:
        def draft(self, context, start, limit):
            return [1] * limit

    costs = StepCosts()
    costs.observe(1, 0.010)
    costs.observe(3, 0.040)  # rows as dear as steps: no draft pays
    speculator = Speculator(Endless(), most=8, costs=costs)

    def gaps(calls: int, accepted: int) -> list[int]:
        out, since = [], 0
        for _ in range(calls):
            since += 1
            drafts = speculator.draft([0], 0, 8)
            if drafts:
                speculator.record(len(drafts), min(accepted, len(drafts)))
                out.append(since)
                since = 0
        return out

    seen = gaps(400, 0)
    assert seen[0] == Speculator.MAX_PAUSE + 2 and all(a < b for a, b in zip(seen[:4], seen[1:5]))
    assert max(seen) <= Speculator.MAX_PAUSE + 2 + Speculator.MAX_IDLE and seen[-1] > 2 * Speculator.MAX_PAUSE
    speculator.rate = 1.0  # a kept probe: back to the shortest pause (rows still too dear to draft more)
    assert gaps(200, 1)[1] == Speculator.MAX_PAUSE + 2
