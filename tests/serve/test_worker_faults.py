"""A request whose end raises (in process, on the engine worker) fails alone: its slot is freed,
it gets its error, and the request decoding beside it keeps the tokens it already chose."""

import asyncio

from pagelm.chat.model import Prompt
from pagelm.engine.sampling import SamplingParams
from pagelm.serve.prefix_cache import PrefixCache
from pagelm.serve.worker import Delta, Failed, Job, Result, StopMatcher, Worker

STORY = "Write a long story about a dragon who lives in a castle."
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=24)


BROKEN = "<a stop string whose matcher breaks>"


def _breaking_flush(flush):
    def flush_or_raise(matcher: StopMatcher) -> str:
        if BROKEN in matcher.stops:
            raise RuntimeError("flush failed")
        return flush(matcher)
    return flush_or_raise


async def _run(worker: Worker, prompt: list[int], params: SamplingParams, stop=()) -> tuple[str, object]:
    job = Job(Prompt(prompt), params, stop)
    worker.submit(job)
    parts = []
    while isinstance(event := await asyncio.wait_for(job.events.get(), timeout=120), Delta):
        parts.append(event.content)
    return "".join(parts), event


async def _beside(worker: Worker, story: list[int], short: list[int]):
    first = asyncio.ensure_future(_run(worker, story, SAMPLED))
    second = asyncio.ensure_future(_run(worker, short, SamplingParams(max_tokens=2), (BROKEN,)))
    return await first, await second


def test_a_failing_finish_frees_its_slot_and_leaves_the_other_answer_alone(smollm2_chat, monkeypatch):
    tokenizer = smollm2_chat.tokenizer
    story, short = tokenizer.encode(STORY), tokenizer.encode("Hi")
    worker = Worker(smollm2_chat.model, tokenizer, ctx_len=256, cache=PrefixCache(0, 0), parallel=2)
    try:
        alone, result = asyncio.run(_run(worker, story, SAMPLED))
        assert isinstance(result, Result) and result.completion_tokens == SAMPLED.max_tokens

        monkeypatch.setattr(StopMatcher, "flush", _breaking_flush(StopMatcher.flush))
        (together, result), (_, failure) = asyncio.run(_beside(worker, story, short))
        assert isinstance(failure, Failed) and "flush failed" in str(failure.error)
        assert isinstance(result, Result) and together == alone
        assert worker.slot_stats()["busy"] == 0
        assert asyncio.run(_run(worker, story, SAMPLED))[0] == alone
    finally:
        worker.close()
    assert worker.failed == 1
