"""A prompt arriving while another stream decodes is prefilled a few layers per step, beside that stream's
decode steps (in process, on the engine worker): with the prefill's share of a step set to nothing, a layer
or so per step (one, or what a step shorter than a typical one leaves), whether the prompt is long (its
share) or short (up to 512 tokens: its own share); both answers are still each one's alone."""

import asyncio

import pytest

from pagelm.chat.model import Prompt
from pagelm.engine.sampling import SamplingParams
from pagelm.serve import worker as worker_module
from pagelm.serve.prefix_cache import PrefixCache
from pagelm.serve.worker import Delta, Job, Result, Worker

STORY = "Write a very long story about a dragon who lives in a castle, chapter by chapter."
CHUNK = 64  # prompt tokens per segment here, so that the long prompt is several segments
LONG = " ".join(f"Item {i}: a lamp, a map and {i % 7} coins." for i in range(14)) + " Which item has the most coins?"


async def _answer(worker: Worker, job: Job, streaming: asyncio.Event | None = None) -> str:
    worker.submit(job)
    parts = []
    while not isinstance(event := await job.events.get(), Result):
        assert isinstance(event, Delta), event
        parts.append(event.content)
        if streaming is not None:
            streaming.set()
    return "".join(parts)


async def _alone_then_together(worker: Worker, story: list[int], long: list[int]):
    alone = [await _answer(worker, Job(Prompt(story), SamplingParams(max_tokens=160))),
             await _answer(worker, Job(Prompt(long), SamplingParams(max_tokens=8)))]
    slices_before = worker.histograms.prefill_slice_seconds.snapshot()["count"]
    streaming = asyncio.Event()
    first = asyncio.ensure_future(_answer(worker, Job(Prompt(story), SamplingParams(max_tokens=160)), streaming))
    await streaming.wait()  # the stream is decoding before the long prompt arrives
    second = await _answer(worker, Job(Prompt(long), SamplingParams(max_tokens=8)))
    together = [await first, second]
    return alone, together, worker.histograms.prefill_slice_seconds.snapshot()["count"] - slices_before


@pytest.mark.parametrize("share", [{"PREFILL_SHARE": 0.0, "SHORT_PROMPT_TOKENS": 100},  # a long prompt's share
                                   {"SHORT_PROMPT_SHARE": 0.0}])  # a short one's (up to 512 tokens)
def test_a_prompt_beside_a_decoding_stream_is_prefilled_a_layer_a_step(smollm2_chat, monkeypatch, share):
    for name, value in share.items():
        monkeypatch.setattr(worker_module, name, value)
    tokenizer = smollm2_chat.tokenizer
    story, long = tokenizer.encode(STORY), tokenizer.encode(LONG)
    assert len(long) > 2 * CHUNK and len(story) < 100 < len(long)
    worker = Worker(smollm2_chat.model, tokenizer, ctx_len=512, cache=PrefixCache(0, 0), parallel=2,
                    prefill_chunk=CHUNK)
    try:
        alone, together, slices = asyncio.run(_alone_then_together(worker, story, long))
    finally:
        worker.close()
    assert together == alone
    layers = len(smollm2_chat.model.network.layers)  # each of its >= 3 segments: that many layers to slice
    assert slices >= layers // 2, f"{slices} prefill slices for a prompt of {len(long)} tokens beside a stream"
