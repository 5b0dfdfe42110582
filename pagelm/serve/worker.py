"""The server's one engine thread: requests queued in order, never interleaved in the session,
each prefilled from the longest cached prefix and streamed back as text deltas.

Owns the queue, cancel-by-id, the prefill split points (message boundaries and every
`checkpoint_interval` tokens but inside an image, the same with the cache on or off so both
compute the same segments; with the cache on, the whole prompt is checkpointed too, for the same
request again), stop strings and the reasoning split. HTTP shapes belong to the protocol modules.

After a chat answer has gone out, the cache keeps the answer as the next request will render it
(`Prompt.answered`), not as it was generated: Qwen3.5's template writes a past answer without the
think block its generation prompt had, and a state computed token by token in decode is not the
one a prefill computes. From the longest checkpoint of that rendering, the rest (the answer,
header and end: at most 64 tokens more than were generated, or nothing is done) is prefilled split
at the same points a later request's prefill uses, and checkpointed. This is skipped when another
request is already waiting as the reply goes out (decided before it goes out, so a client that
waits for each reply always finds it done); once begun it runs to its end.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Callable

from pagelm import heap
from pagelm.chat.model import Prompt
from pagelm.chat.reasoning import ReasoningSplitter
from pagelm.chat.tokenizer import StreamDecoder, Tokenizer
from pagelm.engine import Model, Session
from pagelm.errors import PagelmError
from pagelm.grammar import Grammar
from pagelm.sampling import SamplingParams
from pagelm.serve.prefix_cache import PrefixCache

log = logging.getLogger("pagelm.serve")


@dataclass
class Delta:
    reasoning: str
    content: str


@dataclass
class Result:
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"  # stop | length | cancelled
    queued_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.queued_s + self.prefill_s + self.decode_s


@dataclass
class Failed:
    error: Exception


class QueueFull(PagelmError):
    pass


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back a tail that might begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was reached)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self.held = ""
            return buf[: min(found)], True
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class _Answer:
    """Passes a job's events on to `emit` and keeps the text of the answer they carry."""

    def __init__(self, emit: Callable):
        self._emit, self.reasoning, self.content = emit, [], []

    def emit(self, event) -> None:
        if isinstance(event, Delta):
            self.reasoning.append(event.reasoning)
            self.content.append(event.content)
        self._emit(event)


class Job:
    """One request's trip through the worker; events arrive on `events` in the caller's loop."""

    _ids = itertools.count(1)

    def __init__(self, prompt: Prompt, params: SamplingParams, stop: tuple[str, ...] = (),
                 max_len: int | None = None, request_id: str | None = None, grammar: Grammar | None = None):
        self.id = request_id or f"req-{uuid.uuid4().hex[:20]}"
        self.prompt, self.params, self.stop, self.max_len = prompt, params, stop, max_len
        self.grammar = grammar
        self.cancel = threading.Event()
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.submitted = time.perf_counter()

    def emit(self, event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Worker:
    """Runs jobs one at a time on one session of `model` (context `ctx_len`)."""

    def __init__(self, model: Model, tokenizer: Tokenizer, ctx_len: int, cache: PrefixCache,
                 checkpoint_interval: int = 512, queue_size: int = 64):
        self.model, self.tokenizer, self.ctx_len = model, tokenizer, ctx_len
        self.cache, self.checkpoint_interval = cache, checkpoint_interval
        self.session: Session = model.session(ctx_len)
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._jobs: dict[str, Job] = {}  # queued or running, for cancel by id
        self._lock = threading.Lock()
        self.served = self.cancelled = self.failed = 0
        self.running: Job | None = None
        self._thread = threading.Thread(target=self._loop, name="pagelm-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if job.id in self._jobs:
                raise PagelmError(f"request id {job.id!r} is already in use")
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise QueueFull(f"the request queue is full ({self._queue.maxsize} waiting)") from None
            self._jobs[job.id] = job

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            job = self._jobs.get(request_id)
        if job is not None:
            job.cancel.set()
        return job is not None

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        """Whether the engine thread still runs (a crash outside a request would end it)."""
        return self._thread.is_alive()

    def close(self) -> None:
        for job in list(self._jobs.values()):
            job.cancel.set()
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            self.running = job
            try:
                answer = _Answer(job.emit)
                result = self._run(job, answer.emit)
                self.cancelled += result.finish_reason == "cancelled"
                self.served += 1
                idle = self._queue.empty()
                job.emit(result)
                if idle and result.finish_reason != "cancelled":
                    self._keep_answer(job.prompt, answer, result.completion_tokens)
            except Exception as e:  # noqa: BLE001 - the worker must outlive any one request
                if not isinstance(e, PagelmError):
                    log.exception("request %s failed", job.id)
                self.failed += 1
                self.session.reset()  # a failure may leave the state half-updated
                job.emit(Failed(e))
            finally:
                self.running = None
                with self._lock:
                    self._jobs.pop(job.id, None)
                if self._queue.empty():
                    heap.trim()  # idle: give back what the request's temporaries left in every malloc arena

    def _split_points(self, prompt: Prompt, start: int, end: int) -> list[int]:
        points = {b for b in prompt.boundaries if start < b < end}
        if self.checkpoint_interval > 0:
            first = (start // self.checkpoint_interval + 1) * self.checkpoint_interval
            points.update(range(first, end, self.checkpoint_interval))
        return sorted(p for p in points if not prompt.cuts_image(p))

    def _run(self, job: Job, emit: Callable) -> Result:
        prompt, session, cache = job.prompt.tokens, self.session, self.cache
        max_len = min(job.max_len or self.ctx_len, self.ctx_len)
        result = Result(prompt_tokens=len(prompt), queued_s=time.perf_counter() - job.submitted)
        if job.cancel.is_set():
            result.finish_reason = "cancelled"
            return result
        if not prompt:
            raise PagelmError("the prompt is empty")
        if len(prompt) >= max_len:
            raise PagelmError(f"prompt of {len(prompt)} tokens does not fit the context of {max_len} tokens")
        start = time.perf_counter()
        base = cache.lookup(prompt, job.prompt.image_keys)
        if base is not None:
            cache.restore(base, session)
            result.cached_tokens = len(base.tokens)
        else:
            session.reset()
        cursor = len(session.tokens)
        for point in self._split_points(job.prompt, cursor, len(prompt)):
            if job.cancel.is_set():
                result.finish_reason = "cancelled"
                return result
            session.prefill(prompt[cursor:point], job.prompt.images_in(cursor, point))
            cursor = point
            base = cache.store(session, base) or base
        if cursor < len(prompt) and cache.enabled:  # the same prompt again finds nothing left to prefill
            session.prefill(prompt[cursor:], job.prompt.images_in(cursor, len(prompt)))
            cursor = len(prompt)
            cache.store(session, base, whole=True)

        stops = tuple(job.params.stop_tokens) + self.tokenizer.eos_ids
        params = replace(job.params, stop_tokens=stops,
                         max_tokens=min(job.params.max_tokens, max_len - len(prompt)))
        decoder = StreamDecoder(self.tokenizer)
        matcher = StopMatcher(job.stop)
        splitter = ReasoningSplitter(job.prompt.think_open) if job.prompt.split_reasoning else None

        def send(text: str) -> None:
            reasoning, content = splitter.push(text) if splitter else ("", text)
            if reasoning or content:
                emit(Delta(reasoning, content))

        result.finish_reason = "length"
        stopped = False  # by a stop string
        constraint = None if job.grammar is None else job.grammar.matcher(
            after_reasoning=job.prompt.think_open and job.prompt.split_reasoning)
        tokens = session.generate(prompt[cursor:], params, cancel=job.cancel, constraint=constraint,
                                  images=job.prompt.images_in(cursor, len(prompt)))
        for token in tokens:
            if result.completion_tokens == 0:
                result.prefill_s = time.perf_counter() - start
                start = time.perf_counter()
            result.completion_tokens += 1
            if token in stops:
                result.finish_reason = "stop"
                break
            text, stopped = matcher.push(decoder.push(token))
            send(text)
            if stopped:
                result.finish_reason = "stop"
                break
        tokens.close()
        if result.completion_tokens == 0:
            result.prefill_s = time.perf_counter() - start
            start = time.perf_counter()
        if job.cancel.is_set() and result.finish_reason == "length":
            result.finish_reason = "cancelled"
        if not stopped:
            text, stopped = matcher.push(decoder.flush())
            send(text if stopped else text + matcher.flush())
        if splitter:
            reasoning, content = splitter.finish()
            if reasoning or content:
                emit(Delta(reasoning, content))
        result.decode_s = time.perf_counter() - start
        return result

    def _keep_answer(self, prompt: Prompt, answer: _Answer, generated: int) -> None:
        """Checkpoint the answer as the next request will render it (see the module docstring)."""
        if prompt.answered is None or not self.cache.enabled:
            return
        try:
            kept = prompt.answered("".join(answer.reasoning), "".join(answer.content))
            if kept is None or len(kept.tokens) >= self.ctx_len:
                return
            base = self.cache.longest(kept.tokens, kept.image_keys)
            if base is None or not 0 < len(kept.tokens) - len(base.tokens) <= generated + 64:
                return
            self.cache.restore(base, self.session)
            for point in [*self._split_points(kept, len(base.tokens), len(kept.tokens)), len(kept.tokens)]:
                held = len(self.session.tokens)
                self.session.prefill(kept.tokens[held:point], kept.images_in(held, point))
                base = self.cache.store(self.session, base) or base
        except Exception:  # noqa: BLE001 - the reply is out; the next request finds a reset session
            log.exception("keeping the answer in the prefix cache failed")
            self.session.reset()
