"""The server's one engine thread: up to `parallel` requests at once, each in a slot (a session of
its own), admitted in arrival order from a bounded queue; each step decodes one token of every
decoding slot in one batched decode and prefills one segment of a waiting prompt. Where slots
speculate (prompt lookup, a request's predicted output), their drafts join that step as more rows
of their sequences (a batched verify pass, the fewer drafts the fuller the batch) and each slot
keeps the tokens its own choice makes, so the answers are the same.

Owns the slots and the queue, cancel-by-id, the prefill cut points (message boundaries and every
`checkpoint_interval` tokens but inside an image, the same with the cache on or off so both
compute the same segments; with the cache on, the whole prompt is checkpointed too, for the same
request again), stop strings and the reasoning split. HTTP shapes belong to the protocol modules.

Answers do not depend on the load: a prompt is also cut every `prefill_chunk` tokens counted from
its start, the same places whatever else runs, and a decode step gives each sequence bit for bit
the logits it would get alone (`pagelm.engine.batch.decode_batch`). With one slot, prompts are not
chunked: today's arithmetic. While other slots decode, a segment of a prompt is computed a few
layers per step (`Session.prefill_layers`), a share of the step's decode time (twice it for a
prompt of up to 512 tokens, as long as it for a longer one), so that a prompt arriving slows the
running streams' tokens by a bounded factor; where a segment pauses changes no bit.

After a chat answer has gone out, the cache keeps the answer as the next request will render it
(`Prompt.answered`), not as it was generated: Qwen3.5's template writes a past answer without the
think block its generation prompt had, and a state computed token by token in decode is not the
one a prefill computes. From the longest checkpoint of that rendering, the rest (the answer,
header and end: at most 64 tokens more than were generated, or nothing is done) is prefilled cut
at the same points a later request's prefill uses, and checkpointed at its split points and end. That is done at once when
the engine is otherwise idle as the reply goes out (decided before it goes out, so a client that
waits for each reply always finds it done), else later when nothing runs or waits (the most
recent `parallel` answers are kept for it); it never delays a running stream.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Generator
from dataclasses import dataclass, replace

import numpy as np

from pagelm.runtime import heap
from pagelm.engine.batch import MAX_BATCH, decode_batch
from pagelm.chat.budget import answer_constraint
from pagelm.chat.model import Prompt
from pagelm.chat.tokenizer import StreamDecoder, Tokenizer
from pagelm.engine.model import Model
from pagelm.engine.session import Chooser, Session, verify_passes
from pagelm.engine.speculate import DraftModel, MtpDraft, Prediction, SpeculationStats, Speculator, check_mode
from pagelm.errors import PagelmError
from pagelm.chat.grammar import Grammar
from pagelm.engine.sampling import SamplingParams
from pagelm.serve.metrics import EngineHistograms
from pagelm.serve.prefix_cache import Checkpoint, PrefixCache

log = logging.getLogger("pagelm.serve")
# Prompt tokens per prefill segment when several slots share the engine. Each segment dequantizes
# every matrix once: on the 0.8B, 64-token segments prefilled 118-120 tok/s, 128-token ones 149-159,
# 256-token ones 164-183 (its temporaries at their peak: +23, +41, +90 MiB). A segment is sliced by
# layers between decode steps (below), so its length no longer sets the streams' pauses: 256 cut SmolLM2's
# prefill work at 4 clients by a fifth (9.8 s against 12.5 s a level of `bench concurrency`, share 3 both).
PREFILL_CHUNK = 256
# A step's prefill time while slots decode, over a typical decode step's (the median of the last few
# without drafts; `auto` speculation feeds none while a prompt prefills): a prompt's segment pauses between
# layers once the step and its prefill have taken (1 + the share) typical steps, so that a prompt arriving
# slows the running streams' tokens by a bounded factor, whatever one step's noise. Prompts up to
# SHORT_PROMPT_TOKENS take a larger share: they delay the streams a few steps and start decoding (joining the
# batch) sooner. SmolLM2's inter-token p95 at 4 / 8 clients (`pagelm bench concurrency smollm2-135m --clients
# 1,4,8 --no-long-prompt`, medians of 3): 206 / 224 ms with a short prompt's segment run whole between two
# steps, 72 / 167 with twice that very step's time (longer with drafts), 44 / 89 now (llama-server: 31 / 51
# ms), the time to the first token's p95 1535 / 2545 ms.
PREFILL_SHARE = 1.0
SHORT_PROMPT_SHARE = 2.0
SHORT_PROMPT_TOKENS = 512


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
    # with a predicted output: its tokens the answer took as drafted, and those it did not
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @property
    def total_s(self) -> float:
        return self.queued_s + self.prefill_s + self.decode_s


@dataclass
class Failed:
    error: Exception


class QueueFull(PagelmError):
    pass


class StopMatcher:
    """Cuts streamed text before the first stop string to be completed (of two completed by the same
    character, the longer), holding back a tail that might begin one: where the text is cut into
    pieces does not change what is emitted."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was reached)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        found = [(i + len(s), i) for s in self.stops if (i := buf.find(s)) >= 0]
        if found:
            self.held = ""
            return buf[: min(found)[1]], True
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class Job:
    """One request's trip through the worker; events arrive on `events` in the caller's loop."""

    _ids = itertools.count(1)

    def __init__(self, prompt: Prompt, params: SamplingParams, stop: tuple[str, ...] = (),
                 max_len: int | None = None, request_id: str | None = None, grammar: Grammar | None = None,
                 prediction: list[int] | None = None):
        self.id = request_id or f"req-{uuid.uuid4().hex[:20]}"
        self.prompt, self.params, self.stop, self.max_len = prompt, params, stop, max_len
        self.grammar = grammar
        self.prediction = prediction  # the tokens of a predicted output (OpenAI's `prediction`): drafts
        self.cancel = threading.Event()
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.submitted = time.perf_counter()

    def emit(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the caller's loop has closed: nobody is left to tell
            pass


@dataclass
class _KeptAnswer:
    prompt: Prompt
    reasoning: str
    content: str
    generated: int


class _Running:
    """A job in a slot: where its prompt's prefill stands (`cuts` left, of which `stores` are
    checkpointed), then its token choice and the text pipeline of its answer."""

    def __init__(self, job: Job, session: Session, result: Result, base: Checkpoint | None,
                 cuts: list[int], stores: set[int]):
        self.job, self.session, self.result, self.base = job, session, result, base
        self.cuts, self.stores = cuts, stores
        self.started = time.perf_counter()
        self.last_token_at = 0.0
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.segment: Generator | None = None  # the prefill segment in progress
        self.segment_s = 0.0
        self.chooser: Chooser | None = None  # set once the prompt is prefilled
        self.logits: np.ndarray | None = None
        self.stops: tuple[int, ...] = ()
        self.max_tokens = 0
        self.decoder: StreamDecoder | None = None
        self.matcher = StopMatcher(job.stop)
        self.speculator: Speculator | None = None  # where it speculates: its drafts, checked in verify passes
        self.pending: int | None = None  # a token chosen (and passed on) in a verify pass, to feed next
        p = job.prompt
        self.splitter = p.splitter() if p.split_reasoning else None

    @property
    def decoding(self) -> bool:
        return self.chooser is not None

    def send(self, text: str) -> None:
        reasoning, content = self.splitter.push(text) if self.splitter else ("", text)
        self._emit(reasoning, content)

    def _emit(self, reasoning: str, content: str) -> None:
        if reasoning or content:
            self.reasoning.append(reasoning)
            self.content.append(content)
            self.job.emit(Delta(reasoning, content))


class Worker:
    """Runs up to `parallel` jobs at once on `model` (context `ctx_len` each); more wait in a FIFO
    queue of `queue_size`."""

    def __init__(self, model: Model, tokenizer: Tokenizer, ctx_len: int, cache: PrefixCache,
                 checkpoint_interval: int = 512, queue_size: int = 64, parallel: int = 1,
                 prefill_chunk: int = PREFILL_CHUNK, speculate: str = "off", draft: Model | None = None):
        if parallel < 1:
            raise PagelmError(f"parallel must be >= 1, got {parallel}")
        check_mode(speculate, model)
        self.speculate = speculate  # for every request; one with a predicted output drafts from it
        self.draft = draft  # a draft model (ChatModel.open_draft): each request's drafts from its own session on it
        self.model, self.tokenizer, self.ctx_len = model, tokenizer, ctx_len
        self.cache, self.checkpoint_interval = cache, checkpoint_interval
        self.queue_size, self.parallel = queue_size, parallel
        self.prefill_chunk = prefill_chunk if parallel > 1 else 0
        # slot 0's session is kept from start to end (one request at a time needs no other);
        # the others are made when a slot is taken and dropped when the whole engine goes idle
        self._sessions: list[Session | None] = [model.session(ctx_len)] + [None] * (parallel - 1)
        self._slots: list[_Running | None] = [None] * parallel
        self._waiting: collections.deque[Job] = collections.deque()
        self._kept: collections.deque[_KeptAnswer] = collections.deque(maxlen=parallel)
        self._jobs: dict[str, Job] = {}  # waiting or running, for cancel by id
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._busy = 0  # slots taken (changed under the lock, read by submit)
        self._working = False  # the engine thread has work: requests, answers to keep, the idle trim
        self._closed = False
        self._plain_steps: collections.deque[float] = collections.deque(maxlen=8)  # the last steps without drafts
        self.served = self.cancelled = self.failed = 0
        self.speculation = SpeculationStats()  # every request's drafted and accepted tokens, and verify passes
        self.histograms = EngineHistograms()
        self._thread = threading.Thread(target=self._loop, name="pagelm-engine", daemon=True)
        self._thread.start()

    @property
    def session(self) -> Session:
        """Slot 0's session (the one a single request runs on)."""
        return self._sessions[0]

    def submit(self, job: Job) -> None:
        with self._lock:
            if job.id in self._jobs:
                raise PagelmError(f"request id {job.id!r} is already in use")
            if len(self._waiting) >= self.queue_size + self.parallel - self._busy:
                raise QueueFull(f"the request queue is full ({self.queue_size} waiting)")
            self._waiting.append(job)
            self._jobs[job.id] = job
            self._working = True
            self._wake.notify()

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            job = self._jobs.get(request_id)
            if job is not None:
                job.cancel.set()
                self._wake.notify()
        return job is not None

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return max(0, len(self._waiting) - (self.parallel - self._busy))

    @property
    def running(self) -> Job | None:
        """The longest-running job, or None when every slot is idle."""
        jobs = [s.job for s in self._slots if s is not None]
        return min(jobs, key=lambda j: j.submitted) if jobs else None

    def slot_stats(self) -> dict:
        slots = list(self._slots)
        busy = sum(s is not None for s in slots)
        # working: 1 until the engine has also kept the last answers and trimmed the heap (what
        # memory readings of an idle server wait for)
        per_slot = [0 if s is None else s.nbytes for s in self._sessions]  # resident pages: asked once each
        return {"total": self.parallel, "busy": busy, "idle": self.parallel - busy, "working": int(self._working),
                "state_bytes": sum(per_slot), "per_slot_state_bytes": per_slot}

    @property
    def alive(self) -> bool:
        """Whether the engine thread still runs (a crash outside a request would end it)."""
        return self._thread.is_alive()

    def close(self) -> None:
        with self._lock:
            for job in list(self._jobs.values()):
                job.cancel.set()
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=10)

    # -- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._closed or self._waiting or self._busy or self._kept):
                    self._working = False
                    self._wake.wait()
                self._working = True
                if self._closed and not (self._waiting or self._busy):
                    return
            try:
                self._step()
            except Exception:  # noqa: BLE001 - the engine must outlive any one step
                log.exception("engine step failed")

    def _step(self) -> None:
        self._admit()
        decode_s = self._decode()
        self._prefill(decode_s or None)
        if not self._busy and not self._waiting:
            if self._kept:
                self._keep_answer(self._kept.pop())
            else:
                heap.trim()  # idle: give back what the requests' temporaries left in every malloc arena

    def _admit(self) -> None:
        """Waiting jobs that were cancelled end at once; the first ones take the free slots."""
        with self._lock:
            for job in [j for j in self._waiting if j.cancel.is_set()]:
                self._waiting.remove(job)
                self._end(job, Result(prompt_tokens=len(job.prompt.tokens), finish_reason="cancelled",
                                      queued_s=time.perf_counter() - job.submitted))
            taken = []
            while self._waiting and self._busy < self.parallel:
                index = self._slots.index(None)
                self._slots[index] = _Running(self._waiting.popleft(), None, None, None, [], set())
                self._busy += 1
                taken.append(index)
        for index in taken:
            job = self._slots[index].job
            self.histograms.queue_wait_seconds.observe(time.perf_counter() - job.submitted)
            try:
                self._slots[index] = self._start(job, index)
            except Exception as e:  # noqa: BLE001 - the worker must outlive any one request
                self._fail(index, job, e)

    def _start(self, job: Job, index: int) -> _Running:
        prompt = job.prompt.tokens
        max_len = min(job.max_len or self.ctx_len, self.ctx_len)
        result = Result(prompt_tokens=len(prompt), queued_s=time.perf_counter() - job.submitted)
        if not prompt:
            raise PagelmError("the prompt is empty")
        if len(prompt) >= max_len:
            raise PagelmError(f"prompt of {len(prompt)} tokens does not fit the context of {max_len} tokens")
        session = self._sessions[index]
        if session is None:
            session = self._sessions[index] = self.model.session(self.ctx_len)
            if self.speculate in ("auto", "mtp") and self.model.network.mtp is not None:
                MtpDraft.of(session)  # from now on the session keeps the hidden states its MTP layer reads
        base = self.cache.lookup(prompt, job.prompt.image_keys) if not job.cancel.is_set() else None
        if base is not None:
            self.cache.restore(base, session)
            result.cached_tokens = len(base.tokens)
        else:
            session.reset()
        cuts, stores = self._cuts(job.prompt, len(session.tokens), len(prompt))
        running = _Running(job, session, result, base, cuts, stores)
        running.max_tokens = min(job.params.max_tokens, max_len - len(prompt))
        if not cuts:  # the whole prompt was cached with its logits
            self._begin_decode(running)
        return running

    def _split_points(self, prompt: Prompt, start: int, end: int) -> list[int]:
        """Where a prefill is cut and checkpointed: message boundaries and every checkpoint interval."""
        points = {b for b in prompt.boundaries if start < b < end}
        if self.checkpoint_interval > 0:
            first = (start // self.checkpoint_interval + 1) * self.checkpoint_interval
            points.update(range(first, end, self.checkpoint_interval))
        return sorted(p for p in points if not prompt.cuts_image(p))

    def _cuts(self, prompt: Prompt, start: int, end: int) -> tuple[list[int], set[int]]:
        """(the ends of the segments a prefill of tokens[start:end] computes, the split points among
        them): also every `prefill_chunk` tokens, so that a prefill takes a bounded share of a step."""
        stores = set(self._split_points(prompt, start, end))
        cuts = set(stores)
        if self.prefill_chunk:
            first = (start // self.prefill_chunk + 1) * self.prefill_chunk
            cuts.update(p for p in range(first, end, self.prefill_chunk) if not prompt.cuts_image(p))
        return sorted(cuts) + ([end] if start < end else []), stores

    def _prefill(self, decode_s: float | None) -> None:
        """The current segment of the prompt of the earliest-admitted slot still prefilling (those cancelled end
        first, whatever their turn): its share of a step that decoded for `decode_s` seconds (None: all of it)."""
        prefilling = [(s.job.submitted, i) for i, s in enumerate(self._slots) if s is not None and not s.decoding]
        for submitted, index in list(prefilling):
            r = self._slots[index]
            if r.job.cancel.is_set():
                r.result.finish_reason = "cancelled"
                self._finish(index, r)
                prefilling.remove((submitted, index))
        if not prefilling:
            return
        in_progress = [i for _, i in prefilling if self._slots[i].segment is not None]
        index = in_progress[0] if in_progress else min(prefilling)[1]  # one half-done segment at a time
        r = self._slots[index]
        try:
            if r.segment is None:
                prompt, cursor = r.job.prompt, len(r.session.tokens)
                r.segment = r.session.prefill_layers(prompt.tokens[cursor:r.cuts[0]], prompt.images_in(cursor, r.cuts[0]))
                r.segment_s = 0.0
            share = SHORT_PROMPT_SHARE if len(r.job.prompt.tokens) <= SHORT_PROMPT_TOKENS else PREFILL_SHARE
            # the step and its prefill together: (1 + share) typical steps, whatever this step took
            pause = None if decode_s is None else (1 + share) * self._typical_step(decode_s) - decode_s
            if not self._advance(r, pause):
                return
            point, r.segment = r.cuts.pop(0), None
            self.histograms.prefill_segment_seconds.observe(r.segment_s)
            if point in r.stores:
                r.base = self.cache.store(r.session, r.base) or r.base
            if not r.cuts:
                if self.cache.enabled:  # the same prompt again finds nothing left to prefill
                    self.cache.store(r.session, r.base, whole=True)
                self._begin_decode(r)
        except Exception as e:  # noqa: BLE001 - the worker must outlive any one request
            self._fail(index, r.job, e)

    def _typical_step(self, decode_s: float) -> float:
        """A decode step's seconds while prompts prefill (no drafts then): the median of the last few."""
        return float(np.median(self._plain_steps)) if self._plain_steps else decode_s

    def _advance(self, r: _Running, allowance: float | None) -> bool:
        """Run r's segment for at least one layer, then as long as another layer of the same
        length fits in `allowance` seconds (None: to its end); whether the segment ended."""
        spent, ended = 0.0, False
        while not ended:
            start = time.perf_counter()
            try:
                next(r.segment)
            except StopIteration:
                ended = True
            layer = time.perf_counter() - start
            spent += layer
            if allowance is not None and spent + layer > allowance:
                break
        r.segment_s += spent
        self.histograms.prefill_slice_seconds.observe(spent)
        return ended

    def _begin_decode(self, r: _Running) -> None:
        job = r.job
        r.stops = tuple(job.params.stop_tokens) + self.tokenizer.eos_ids
        params = replace(job.params, stop_tokens=r.stops, max_tokens=r.max_tokens)
        p = job.prompt
        constraint = answer_constraint(self.tokenizer, job.grammar, p.think_open and p.split_reasoning,
                                       r.max_tokens, params.reasoning_budget, harmony=p.harmony and p.split_reasoning)
        r.logits = r.session.logits
        r.chooser = Chooser(r.session, params, constraint)
        if job.prediction is not None:
            r.speculator = Speculator(Prediction(job.prediction))
        else:
            draft = None if self.draft is None or self.speculate == "off" else \
                DraftModel.of(self.draft, self.model.head.vocab_size, self.ctx_len)
            r.speculator = Speculator.of(self.speculate, draft, r.session)
        r.decoder = StreamDecoder(self.tokenizer)
        r.result.finish_reason = "length"

    def _decode(self) -> float:
        """Each decoding slot chooses its next token and passes it on; those that go on are fed
        theirs in batched decode steps, with drafts after it where a slot speculates (a batched
        verify pass then, whose rows are checked by each slot's own choices). Returns the seconds
        those steps took."""
        going: list[tuple[int, _Running, int]] = []
        for index, r in enumerate(self._slots):
            if r is None or not r.decoding:
                continue
            try:
                token = self._next_token(r) if r.pending is None else r.pending
                r.pending = None
            except Exception as e:  # noqa: BLE001 - the worker must outlive any one request
                self._fail(index, r.job, e)
                continue
            if token is None:
                self._finish(index, r)
            else:
                going.append((index, r, token))
        if going:
            self.histograms.batch_size.observe(len(going))
        took, plain = 0.0, True
        for lo in range(0, len(going), MAX_BATCH):
            part = going[lo: lo + MAX_BATCH]
            try:
                drafts = self._drafts(part)
                start = time.perf_counter()
                sessions, tokens = [r.session for _, r, _ in part], [token for _, _, token in part]
                if any(drafts):
                    rows = verify_passes(sessions, [[token, *d] for token, d in zip(tokens, drafts)])
                else:
                    rows = decode_batch(sessions, tokens)[:, None]
                step_s = time.perf_counter() - start
                took, plain = took + step_s, plain and not any(drafts)
                self.histograms.decode_step_seconds.observe(step_s)
                if len(part) == 1 and part[0][1].speculator is not None:  # a step of its own: its cost
                    part[0][1].speculator.observe(1 + len(drafts[0]), step_s)
            except Exception as e:  # noqa: BLE001 - a failed step fails the requests it held
                for index, r, _ in part:
                    self._fail(index, r.job, e)
                continue
            for (index, r, _), d, got in zip(part, drafts, rows):
                try:
                    self._check_drafts(index, r, d, got)
                except Exception as e:  # noqa: BLE001 - the worker must outlive any one request
                    self._fail(index, r.job, e)
        if going and plain:
            self._plain_steps.append(took)
        return took

    def _drafts(self, part: list[tuple[int, _Running, int]]) -> list[list[int]]:
        """Each going slot's drafts after its token, within the rows one step takes: the fuller the
        batch, the fewer (none for a slot that does not speculate; none for an `auto` one while a prompt
        prefills: its drafts, often not kept, would lengthen that prompt's pauses and every stream's; a
        prediction, a draft model or `lookup` asked for drafts, which go on)."""
        budget, out = MAX_BATCH - len(part), []
        prefilling = any(s is not None and not s.decoding for s in self._slots)
        for _, r, token in part:
            drafts = []
            auto = r.speculator is not None and r.speculator.costs is not None
            if r.speculator is not None and budget > 0 and not (prefilling and auto):
                session = r.session
                room = min(r.max_tokens - r.result.completion_tokens, session.max_len - len(session.tokens)) - 1
                drafts = r.speculator.draft([*session.tokens, token], len(r.job.prompt.tokens), min(room, budget))
                budget -= len(drafts)
            out.append(drafts)
        return out

    def _check_drafts(self, index: int, r: _Running, drafts: list[int], rows: np.ndarray) -> None:
        """After a step fed a slot its token and `drafts` (rows: the logits after each): choose and
        pass on each row's token while it is the draft the next row fed (the first other one is fed
        next step, as `pending`), the session rewound to the last row chosen from."""
        if not drafts:
            r.logits = rows[0]
            return
        session = r.session
        base, kept, ended = len(session.tokens) - len(rows), len(rows), False
        for i, draft in enumerate(drafts):
            r.logits = rows[i]
            chosen = self._next_token(r, held=base + i + 1)
            if chosen is None or chosen != draft:
                kept, ended, r.pending = i + 1, chosen is None, chosen
                break
        else:
            r.logits = rows[-1]
        r.speculator.record(len(drafts), kept - 1)
        total = self.speculation
        total.drafted, total.accepted, total.passes = total.drafted + len(drafts), total.accepted + kept - 1, total.passes + 1
        if kept < len(rows):
            session.rewind(kept)
        if ended:
            self._finish(index, r)

    def _next_token(self, r: _Running, held: int | None = None) -> int | None:
        """Choose and pass on one token; the token to feed next, or None when the answer ends
        (as Session.generate: cancel is checked before each choice, a stop token ends it).
        `held`: as Chooser.choose's."""
        result = r.result
        if r.job.cancel.is_set() or result.completion_tokens >= r.max_tokens:
            return None
        token, done = r.chooser.choose(r.logits, held)
        now = time.perf_counter()
        if result.completion_tokens == 0:
            result.prefill_s = now - r.started
            r.started = now
            self.histograms.time_to_first_token_seconds.observe(now - r.job.submitted)
        else:
            self.histograms.inter_token_latency_seconds.observe(now - r.last_token_at)
        r.last_token_at = now
        result.completion_tokens += 1
        if token in r.stops:
            result.finish_reason = "stop"
            return None
        text, stopped = r.matcher.push(r.decoder.push(token))
        r.send(text)
        if stopped:
            result.finish_reason = "stop"
            r.matcher = None
            return None
        return None if done else token

    def _finish(self, index: int, r: _Running) -> None:
        """Flush the answer's held text, send the Result, free the slot, keep the answer. A flush
        that raises fails the request instead: its slot is freed either way."""
        try:
            self._flush(r)
        except Exception as e:  # noqa: BLE001 - the worker must outlive any one request
            self._fail(index, r.job, e)
            return
        result = r.result
        self.cancelled += result.finish_reason == "cancelled"
        self.served += 1
        kept = None
        if result.finish_reason != "cancelled" and r.job.prompt.answered is not None and self.cache.enabled:
            kept = _KeptAnswer(r.job.prompt, "".join(r.reasoning), "".join(r.content), result.completion_tokens)
        with self._lock:
            idle = self._busy == 1 and not self._waiting  # decided before the reply goes out
        self._release(index, r.job, result)
        if kept is not None:
            if idle:
                self._keep_answer(kept, self._sessions[index] or self.session)
            else:
                self._kept.append(kept)

    def _flush(self, r: _Running) -> None:
        """The answer's held text sent, its Result's reason and times set."""
        result, now = r.result, time.perf_counter()
        if r.chooser is None or result.completion_tokens == 0:
            result.prefill_s = now - r.started
            r.started = now
        if r.job.cancel.is_set() and result.finish_reason == "length":
            result.finish_reason = "cancelled"
        if r.job.prediction is not None and r.speculator is not None:
            result.accepted_prediction_tokens = r.speculator.stats.accepted
            result.rejected_prediction_tokens = max(len(r.job.prediction) - result.accepted_prediction_tokens, 0)
        if r.decoder is not None:
            if r.matcher is not None:  # None: a stop string ended it
                text, stopped = r.matcher.push(r.decoder.flush())
                r.send(text if stopped else text + r.matcher.flush())
            if r.splitter:
                r._emit(*r.splitter.finish())
        result.decode_s = time.perf_counter() - r.started

    def _fail(self, index: int, job: Job, error: Exception) -> None:
        if not isinstance(error, PagelmError):
            log.exception("request %s failed", job.id, exc_info=error)
        self.failed += 1
        session = self._sessions[index]
        if session is not None:
            session.reset()  # a failure may leave the state half-updated
        self._release(index, job, Failed(error))

    def _release(self, index: int, job: Job, event) -> None:
        with self._lock:
            self._slots[index] = None
            self._busy -= 1
            if not self._busy and not self._waiting:
                # the engine is idle: the other slots' states go back (slot 0's stays); while it is
                # busy, a freed slot keeps its state for the next request (no new allocation and
                # page faults per request)
                for i in range(1, self.parallel):
                    self._sessions[i] = None
            self._end(job, event)

    def _end(self, job: Job, event) -> None:
        """(Under the lock.) The job's last event; its id is free again."""
        self._jobs.pop(job.id, None)
        job.emit(event)

    def _keep_answer(self, kept: _KeptAnswer, session: Session | None = None) -> None:
        """Checkpoint the answer as the next request will render it (see the module docstring)."""
        session = session or self.session
        try:
            prompt = kept.prompt.answered(kept.reasoning, kept.content)
            if prompt is None or len(prompt.tokens) >= self.ctx_len:
                return
            base = self.cache.longest(prompt.tokens, prompt.image_keys)
            if base is None or not 0 < len(prompt.tokens) - len(base.tokens) <= kept.generated + 64:
                return
            self.cache.restore(base, session)
            cuts, stores = self._cuts(prompt, len(base.tokens), len(prompt.tokens))
            for point in cuts:
                held = len(session.tokens)
                session.prefill(prompt.tokens[held:point], prompt.images_in(held, point))
                if point in stores or point == len(prompt.tokens):
                    base = self.cache.store(session, base) or base
        except Exception:  # noqa: BLE001 - the reply is out; the next request finds a reset session
            log.exception("keeping the answer in the prefix cache failed")
            session.reset()
