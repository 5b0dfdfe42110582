"""Speculation in the server: a request's predicted output (OpenAI's `prediction`) and prompt lookup
are drafts checked in verify passes while a request decodes alone; the answer is the one it gets
without them, stop strings and seeds included; usage reports the prediction's accepted tokens,
/api/ps and /metrics the server's drafted and accepted tokens."""

import asyncio

import pytest

from pagelm.chat.model import Prompt
from pagelm.engine.sampling import SamplingParams
from pagelm.serve.prefix_cache import PrefixCache
from pagelm.serve.requests import RequestError, prediction_text
from pagelm.serve.worker import Delta, Job, Result, Worker

LIST = "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon"
GREEDY, SEEDED = SamplingParams(max_tokens=40), SamplingParams(temperature=0.7, seed=4, max_tokens=40)


async def _ask(worker: Worker, prompt: list[int], params, stop=(), prediction=None) -> tuple[str, Result]:
    job = Job(Prompt(prompt), params, stop, prediction=prediction)
    worker.submit(job)
    parts = []
    while isinstance(event := await asyncio.wait_for(job.events.get(), timeout=120), Delta):
        parts.append(event.content)
    assert isinstance(event, Result), event
    return "".join(parts), event


@pytest.fixture(scope="module")
def workers(smollm2_chat):
    made = {mode: Worker(smollm2_chat.model, smollm2_chat.tokenizer, ctx_len=256, cache=PrefixCache(0, 0),
                         speculate=mode, parallel=3) for mode in ("off", "lookup")}
    yield made
    for worker in made.values():
        worker.close()


@pytest.mark.parametrize("params", [GREEDY, SEEDED])
def test_predictions_and_lookup_give_the_plain_answer(smollm2_chat, workers, params):
    tok = smollm2_chat.tokenizer
    prompt = smollm2_chat.chat_prompt([{"role": "user", "content": f"Copy this list exactly: {LIST}"}]).tokens
    plain, result = asyncio.run(_ask(workers["off"], prompt, params))
    assert result.accepted_prediction_tokens is None and result.completion_tokens > 10
    looked_up, _ = asyncio.run(_ask(workers["lookup"], prompt, params))
    assert looked_up == plain
    exact = tok.encode(plain)
    got, result = asyncio.run(_ask(workers["off"], prompt, params, prediction=exact))
    assert got == plain and result.accepted_prediction_tokens >= len(exact) // 2, result
    assert result.rejected_prediction_tokens == len(exact) - result.accepted_prediction_tokens
    edited = tok.encode(plain.replace("cherry", "plum, quince"))
    got, result = asyncio.run(_ask(workers["off"], prompt, params, prediction=edited))
    assert got == plain and result.accepted_prediction_tokens > 0
    # a stop string inside the predicted text ends the answer where it ends the plain one
    word = plain.split()[len(plain.split()) // 2]
    want, want_result = asyncio.run(_ask(workers["off"], prompt, params, stop=(word,)))
    got, result = asyncio.run(_ask(workers["off"], prompt, params, stop=(word,), prediction=exact))
    assert got == want and result.completion_tokens == want_result.completion_tokens
    assert result.finish_reason == want_result.finish_reason == "stop"


def test_the_prediction_field_is_read_as_openai_writes_it():
    assert prediction_text(None) is None
    assert prediction_text({"type": "content", "content": "abc"}) == "abc"
    assert prediction_text({"type": "content", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "bc"}]}) == "abc"
    for bad in ("abc", {"type": "other", "content": "x"}, {"type": "content", "content": 3},
                {"type": "content", "content": [{"type": "image"}]}):
        with pytest.raises(RequestError, match="prediction"):
            prediction_text(bad)


def test_usage_reports_the_accepted_prediction_tokens(smol):
    messages = [{"role": "user", "content": f"Copy this list exactly: {LIST}"}]
    body = {"model": smol.model, "messages": messages, "max_tokens": 40, "temperature": 0}
    with smol.client() as client:
        plain = client.post("/v1/chat/completions", json=body).json()
        text = plain["choices"][0]["message"]["content"]
        assert "completion_tokens_details" not in plain["usage"]
        predicted = client.post("/v1/chat/completions",
                                json={**body, "prediction": {"type": "content", "content": text}}).json()
        metrics = client.get("/metrics").text
        ps = client.get("/api/ps").json()
    assert predicted["choices"][0]["message"]["content"] == text
    details = predicted["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] >= 0
    accepted = ps["speculation"]["accepted_tokens"]
    assert ps["speculation"]["drafted_tokens"] >= accepted >= details["accepted_prediction_tokens"]
    assert any(line.startswith("pagelm_speculation_accepted_tokens ") and float(line.split()[1]) > 0
               for line in metrics.splitlines())


def test_requests_decoding_together_verify_their_drafts_in_one_pass(smollm2_chat, workers):
    tok = smollm2_chat.tokenizer
    texts = [f"Copy this list exactly: {LIST}", "Repeat after me: one two three four five six seven eight",
             "Write a short poem about the sea."]
    prompts = [smollm2_chat.chat_prompt([{"role": "user", "content": t}]).tokens for t in texts]
    params = [GREEDY, SEEDED, SamplingParams(temperature=0.9, seed=1, max_tokens=30)]

    async def together(worker, predictions):
        return await asyncio.gather(*(_ask(worker, p, q, prediction=d) for p, q, d in zip(prompts, params, predictions)))

    plain = asyncio.run(together(workers["off"], [None] * 3))
    before = workers["lookup"].speculation.accepted
    looked_up = asyncio.run(together(workers["lookup"], [None] * 3))
    assert [text for text, _ in looked_up] == [text for text, _ in plain]
    assert workers["lookup"].speculation.accepted > before
    predicted = asyncio.run(together(workers["off"], [tok.encode(text) for text, _ in plain]))
    assert [text for text, _ in predicted] == [text for text, _ in plain]
    assert all(result.accepted_prediction_tokens > 0 for _, result in predicted)


def test_a_draft_model_drafts_for_requests_decoding_alone_and_together(smollm2_chat, workers):
    texts = ["Name the planets of the solar system.", "Write a short poem about the sea.",
             f"Copy this list exactly: {LIST}"]
    prompts = [smollm2_chat.chat_prompt([{"role": "user", "content": t}]).tokens for t in texts]
    params = [GREEDY, SEEDED, SamplingParams(temperature=0.9, seed=1, max_tokens=30)]
    drafting = Worker(smollm2_chat.model, smollm2_chat.tokenizer, ctx_len=256, cache=PrefixCache(0, 0),
                      speculate="lookup", parallel=3, draft=smollm2_chat.model)  # the model drafting for itself
    try:
        async def together(worker):
            return await asyncio.gather(*(_ask(worker, p, q) for p, q in zip(prompts, params)))

        plain = asyncio.run(together(workers["off"]))
        assert [text for text, _ in asyncio.run(together(drafting))] == [text for text, _ in plain]
        alone, _ = asyncio.run(_ask(drafting, prompts[0], GREEDY))
        assert alone == plain[0][0]
        assert drafting.speculation.accepted > drafting.speculation.drafted // 2 > 0
    finally:
        drafting.close()


def test_the_mtp_layer_drafts_for_requests_alone_and_together(qwen35_mtp_chat_gguf):
    """With the prefix cache on, the second round restores each prompt's start: the layer then reads
    only the hidden states computed after it."""
    from pagelm.chat.model import ChatModel

    chat = ChatModel.open(qwen35_mtp_chat_gguf)
    texts = ["Name the planets of the solar system.", "Count from one to ten.", "Write a haiku about rain."]
    prompts = [chat.chat_prompt([{"role": "user", "content": t}]).tokens for t in texts]
    params = [GREEDY, SEEDED, SamplingParams(temperature=0.9, seed=1, max_tokens=30)]
    workers = {mode: Worker(chat.model, chat.tokenizer, ctx_len=256, cache=PrefixCache(8, 1 << 26), speculate=mode,
                            parallel=3, checkpoint_interval=16) for mode in ("off", "mtp")}
    try:
        async def together(worker):
            return await asyncio.gather(*(_ask(worker, p, q) for p, q in zip(prompts, params)))

        plain = [text for text, _ in asyncio.run(together(workers["off"]))]
        for _ in range(2):
            assert [text for text, _ in asyncio.run(together(workers["mtp"]))] == plain
        assert asyncio.run(_ask(workers["mtp"], prompts[0], GREEDY))[0] == plain[0]
        assert workers["mtp"].speculation.drafted > 0
    finally:
        for worker in workers.values():
            worker.close()
