"""The server core: its settings, the loaded model and its worker, and what a request does on
the way to the worker (body, model check, prompt and grammar plan, queueing, events, errors).

The protocol modules (`openai_api`, `ollama_api`) build their answers on this; it knows no
route, no protocol's body shape beyond its error shape, and nothing of the Starlette app.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagelm.chat.model import ChatModel, Prompt
from pagelm.chat.tools import AnswerCallStream, PlainStream, Tool, ToolCallStream, ToolFormat
from pagelm.errors import ImageError, PagelmError
from pagelm.chat.grammar import Grammar, GrammarError
from pagelm.engine.embed import Embedder
from pagelm.measure.memory import read_memory
from pagelm.models.moe import ExpertTraffic, track
from pagelm.quant.compile_progress import CompileProgress
from pagelm.weights.pooling import embedding_head
from pagelm.engine.sampling import SamplingParams
from pagelm.serve.prefix_cache import PrefixCache
from pagelm.serve.requests import MAX_JSON_DEPTH, RequestError, check_body, request_id
from pagelm.serve.worker import Delta, Failed, Job, QueueFull, Result, Worker
from pagelm.vision.preprocess import DEFAULT_MAX_TOKENS, DEFAULT_MIN_TOKENS

GRAMMAR_CACHE_SIZE = 32  # compiled grammars kept, least recently used dropped


@dataclass(frozen=True)
class JsonAnswer:
    """A request for an answer that is JSON: any object (schema None) or one a schema validates."""

    schema: dict | None = None


@dataclass
class ChatPlan:
    """A chat request made ready: its prompt, the grammar the answer must follow, and the tools
    whose calls are read back out of the answer."""

    prompt: Prompt
    grammar: Grammar | None = None
    tools: list[Tool] = field(default_factory=list)
    form: ToolFormat | None = None

    def answer_stream(self) -> ToolCallStream | AnswerCallStream | PlainStream:
        """What splits this request's streamed answer into content and tool calls."""
        return self.form.stream(self.tools) if self.tools else PlainStream()


@dataclass
class ServeSettings:
    model_path: str
    model_name: str
    ctx_len: int = 4096
    prefix_slots: int = 32
    prefix_cache_mib: int = 1024
    checkpoint_interval: int = 512
    embedding: str = "mapped"
    weights: str = "mapped"
    dtype: str = "bfloat16"
    threads: int | None = None
    api_key: str | None = None
    queue_size: int = 64
    parallel: int = 4  # requests the engine runs at once (slots); more wait in the queue
    max_body_mib: int = 32
    max_tokens: int = 2048  # when a request does not say
    mmproj: str | None = None  # the vision tower; None: one found beside the model, if any
    image_cache_mib: int = 256
    image_tokens: tuple[int, int] = (DEFAULT_MIN_TOKENS, DEFAULT_MAX_TOKENS)  # an image is resized within
    ui: bool = True  # the chat page on GET /
    reasoning_budget: int | None = None  # when a request does not say (pagelm.chat.budget)
    host: str = "127.0.0.1"  # the address bound: on loopback, only loopback names (and allowed_hosts) are answered
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed besides loopback and the server's own ("*": any)
    speculate: str = "auto"  # engine.speculate.MODES: drafts (prompt lookup) while one request decodes
    draft: str | None = None  # a draft model's path: drafts from it instead (ChatModel.open_draft)


class Server:
    """What the routes share: settings, the model once loaded, the worker and its cache."""

    def __init__(self, settings: ServeSettings):
        self.settings = settings
        self.chat: ChatModel | None = None
        self.worker: Worker | None = None  # a generative model's engine thread
        self.embedder: Embedder | None = None  # an embedding model's
        self._embedding = asyncio.Lock()  # one request at a time: its inputs' passes take every compute thread
        self.cache = PrefixCache(settings.prefix_slots, settings.prefix_cache_mib << 20)
        self.load_error: Exception | None = None
        self.load_s = 0.0
        self.compiling: CompileProgress | None = None  # while loading: what /health says is happening
        self.expert_traffic: ExpertTraffic | None = None  # a mixture of experts' bytes read per decoded token
        self.started = time.time()
        self.on_load = lambda error: None  # called from the loading thread: None on success
        self._grammars: OrderedDict[tuple[str, str], Grammar] = OrderedDict()

    def load(self) -> None:
        start = time.perf_counter()
        self.compiling = CompileProgress(live=False)  # a log: two lines, not one rewritten
        try:
            s = self.settings
            with self.compiling:
                chat = ChatModel.open(s.model_path, name=s.model_name, embedding=s.embedding, weights=s.weights,
                                      dtype=s.dtype, threads=s.threads, mmproj=s.mmproj,
                                      image_cache_mib=s.image_cache_mib, image_tokens=s.image_tokens)
            self.expert_traffic = track(chat.model.network)
            head = embedding_head(chat.model.loader)
            if head is not None:
                self.embedder = Embedder(chat.model, head)
            else:
                draft = None if s.draft is None else chat.open_draft(s.draft, s.weights, s.dtype, s.threads)
                self.worker = Worker(chat.model, chat.tokenizer, s.ctx_len, self.cache, s.checkpoint_interval,
                                     s.queue_size, s.parallel, speculate=s.speculate, draft=draft)
            self.chat = chat
        except Exception as e:  # noqa: BLE001 - reported by the CLI, which then exits
            self.load_error = e
        self.load_s = time.perf_counter() - start
        self.on_load(self.load_error)

    @property
    def ready(self) -> bool:
        return self.chat is not None

    def require_ready(self) -> ChatModel:
        if self.chat is None:
            raise RequestError("the model is still loading", status=503, headers={"Retry-After": "1"})
        return self.chat

    def require_generative(self) -> ChatModel:
        chat = self.require_ready()
        if self.worker is None:
            raise RequestError(f"model '{chat.name}' is an embedding model: it makes vectors, not text "
                               f"(POST /v1/embeddings or /api/embed)")
        return chat

    def require_embedder(self) -> Embedder:
        chat = self.require_ready()
        if self.embedder is None:
            raise RequestError(f"model '{chat.name}' is not an embedding model: it has no pooling (an embedding "
                               f"model's file says how to pool; this one generates text)", param="model")
        return self.embedder

    async def embed(self, texts_or_tokens: list, truncate: bool, dimensions: int | None) -> tuple[np.ndarray, int]:
        """(vectors (n, dims), prompt tokens) of inputs given as text or token ids, computed together
        (Embedder.embed_all), each the bits of its input alone; an input past the context is cut to it
        when `truncate`, else a 400 naming the limit."""
        embedder, chat = self.require_embedder(), self.require_ready()
        if dimensions is not None and dimensions > embedder.dimensions:
            raise RequestError(f"dimensions must be at most {embedder.dimensions} for model '{chat.name}', "
                               f"got {dimensions}", param="dimensions")
        limit = self.settings.ctx_len
        inputs = []
        for i, item in enumerate(texts_or_tokens):
            cut = limit if truncate else None
            tokens = chat.tokenizer.encode_input(item, cut) if isinstance(item, str) else list(item)[:cut]
            if not tokens:
                raise RequestError(f"input {i} is empty", param="input")
            if len(tokens) > limit:
                raise RequestError(f"input {i} is {len(tokens)} tokens long, more than the context of {limit} "
                                   f"(allow truncation to embed its first {limit})", param="input",
                                   code="context_length_exceeded")
            if max(tokens) >= chat.model.config.vocab:
                raise RequestError(f"input {i}: token ids must be below the vocabulary size "
                                   f"{chat.model.config.vocab}", param="input")
            inputs.append(tokens)
        async with self._embedding:
            vectors = await run_in_threadpool(embedder.embed_all, inputs, dimensions)
        return vectors, sum(len(t) for t in inputs)

    def check_model(self, name: object) -> None:
        chat = self.require_ready()
        if not isinstance(name, str) or not name:
            raise RequestError("model is required (a string)", param="model")
        known = {chat.name, str(chat.path), chat.path.name, chat.path.stem}
        if name not in known and name.removesuffix(":latest") not in known:
            raise RequestError(f"model '{name}' not found (this server serves '{chat.name}')", status=404,
                               param="model", code="model_not_found")

    async def read_json(self, request: Request) -> dict:
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            # text/plain and form types are what a page of another site may POST without asking first
            raise RequestError(f"the body must be sent as Content-Type: application/json, got "
                               f"{media_type or 'none'} (curl: -H 'Content-Type: application/json')", status=415)
        limit = self.settings.max_body_mib << 20
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes", status=413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise RequestError(f"request body exceeds the limit of {limit} bytes", status=413)
        try:
            value = json.loads(body)
        except ValueError as e:  # not UTF-8, not JSON, an integer past Python's digit limit
            raise RequestError(f"malformed JSON body: {e}") from None
        except RecursionError:
            raise RequestError(f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels") from None
        if not isinstance(value, dict):
            raise RequestError(f"the body must be a JSON object, got {type(value).__name__}")
        check_body(value)
        return value

    async def plan_chat(self, messages: list[dict], think: bool | str | None, tools: list[Tool] = (),
                        choice: str | Tool = "auto", parallel: bool = True, answer: JsonAnswer | None = None,
                        images: list[bytes] = ()) -> ChatPlan:
        """The prompt with the tools and `images` (those of the messages' image parts, in order)
        rendered in, and the grammar that `choice` (a forced call) or `answer` (JSON) asks for.
        `choice` none offers no tools: none rendered, none parsed."""
        chat = self.require_generative()
        if images and chat.model.tower is None:
            raise RequestError(f"model '{chat.name}' has no vision support: it cannot read the {len(images)} "
                               f"image(s) in this request")
        tools = list(tools) if choice != "none" else []
        form = chat.tool_form if tools else None
        if tools and form is None:
            raise RequestError(f"model '{chat.name}' cannot call tools: its chat template renders no tool calls",
                               param="tools")
        forced = choice == "required" or isinstance(choice, Tool)
        if forced and answer is not None:
            raise RequestError("a JSON answer format and a tool_choice that forces a call cannot be combined",
                               param="response_format")

        def render() -> Prompt:
            prepared = []
            for i, data in enumerate(images):
                try:
                    prepared.append(chat.prepare_image(data))
                except ImageError as e:
                    raise RequestError(f"image {i + 1} of the request: {e}") from None
            return chat.chat_prompt(messages, think, [t.for_template() for t in tools] or None, prepared)

        try:
            prompt = await run_in_threadpool(render)
        except PagelmError as e:  # the template's own refusals, placeholders that do not match the images
            raise RequestError(str(e)) from None
        grammar = None
        if forced:
            chosen = [choice] if isinstance(choice, Tool) else tools
            grammar = await self.grammar("lark", form.grammar(chosen, parallel and not isinstance(choice, Tool)),
                                          "tools")
        elif answer is not None:
            grammar = await self.json_grammar(answer)
        return ChatPlan(prompt, grammar, tools, form)

    async def json_grammar(self, answer: JsonAnswer | None) -> Grammar | None:
        if answer is None:
            return None
        return await self.grammar("json", json.dumps(answer.schema, sort_keys=True), "response_format")

    async def grammar(self, kind: str, text: str, param: str) -> Grammar:
        """A compiled grammar (Lark text, or a JSON schema as JSON text), from the cache when it can."""
        key = (kind, text)
        if key in self._grammars:
            self._grammars.move_to_end(key)
            return self._grammars[key]
        tokenizer = self.require_ready().tokenizer
        try:
            if kind == "lark":
                grammar = await run_in_threadpool(Grammar.lark, tokenizer, text)
            else:
                grammar = await run_in_threadpool(Grammar.json_schema, tokenizer, json.loads(text))
        except GrammarError as e:
            raise RequestError(str(e), param=param) from None
        self._grammars[key] = grammar
        while len(self._grammars) > GRAMMAR_CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar

    async def raw_prompt(self, text: str) -> Prompt:
        return await run_in_threadpool(self.require_generative().raw_prompt, text)

    def start(self, request: Request, prompt: Prompt, params: SamplingParams, stop: tuple[str, ...],
              id_prefix: str, max_len: int | None = None, grammar: Grammar | None = None,
              prediction: list[int] | None = None) -> Job:
        """Queue a generation; 400 if the prompt cannot fit, 503 if the queue is full. `prediction`:
        the tokens of a predicted output, drafts for the answer."""
        self.require_generative()
        limit = min(max_len or self.settings.ctx_len, self.settings.ctx_len)
        if not prompt.tokens:
            raise RequestError("the prompt is empty")
        if len(prompt.tokens) >= limit:
            raise RequestError(f"the prompt is {len(prompt.tokens)} tokens long but the context is {limit} tokens "
                               f"(it must leave room for at least one generated token)", code="context_length_exceeded")
        rid = request_id(request.headers.get("x-request-id"))
        if params.reasoning_budget is None:
            params = replace(params, reasoning_budget=self.settings.reasoning_budget)
        job = Job(prompt, params, stop, max_len=limit, request_id=rid or f"{id_prefix}-{_hex_id()}", grammar=grammar,
                  prediction=prediction)
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise RequestError(str(e), status=503, headers={"Retry-After": "2"}) from None
        except PagelmError as e:
            raise RequestError(str(e), status=409) from None
        return job

    def endpoint(self, handler):
        """Wrap a route handler: API key check, and RequestError → the protocol's error shape."""
        key = self.settings.api_key

        async def guarded(request: Request) -> Response:
            try:
                if key is not None:
                    given = request.headers.get("authorization", "")
                    given = given[7:] if given.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
                    if not hmac.compare_digest(given.encode(), key.encode()):
                        raise RequestError("invalid or missing API key (send Authorization: Bearer KEY)",
                                           status=401, code="invalid_api_key")
                return await handler(request)
            except RequestError as e:
                return error_response(e, request)

        return guarded

    def max_tokens(self, value: int | None) -> int:
        return self.settings.max_tokens if value is None else value

    async def current_stats(self) -> dict:
        """What /api/ps and /metrics report; a server whose engines run elsewhere asks them."""
        return self.stats()

    def stats(self) -> dict:
        w = self.worker
        memory = read_memory()
        return {
            "prefix_cache": self.cache.stats(),
            "image_cache": self.chat.model.image_cache.stats() if self.chat else {},
            "requests": {"served": w.served if w else 0, "cancelled": w.cancelled if w else 0,
                         "failed": w.failed if w else 0, "queued": w.queued if w else 0,
                         "running": bool(w and w.running)},
            "slots": w.slot_stats() if w else {},
            "speculation": {"drafted_tokens": w.speculation.drafted, "accepted_tokens": w.speculation.accepted,
                            "verify_passes": w.speculation.passes} if w else {},
            "histograms": w.histograms.snapshot() if w else {},
            **({"experts": self._expert_stats()} if self.expert_traffic is not None else {}),
            "memory": {"anonymous_bytes": memory.anonymous, "rss_bytes": memory.rss,
                       "file_rss_bytes": memory.file_rss, "peak_rss_bytes": memory.peak_rss,
                       "weights_anonymous_bytes": self.chat.model.weights_nbytes if self.chat else 0,
                       "tokenizer_anonymous_bytes": self.chat.tokenizer_anonymous_bytes if self.chat else 0,
                       "state_bytes": w.slot_stats()["state_bytes"] if w else 0},
        }


    def _expert_stats(self) -> dict:
        t = self.expert_traffic
        return {"expert_bytes": t.expert_bytes, "layers": t.layers, "decoded_tokens": t.rows // t.layers,
                "touched_bytes_per_token": round(t.per_token)}


def _hex_id() -> str:
    return uuid.uuid4().hex[:24]


async def events(job: Job, request: Request | None = None) -> AsyncIterator[Delta | Result]:
    """The job's events until its Result; a Failed event raises. With `request`, a client that
    disconnects cancels the job (for responses that are not streamed)."""
    loop = asyncio.get_running_loop()
    check_at = loop.time() + 0.25
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                event = None
            if request is not None and loop.time() >= check_at:  # also while tokens keep coming
                check_at = loop.time() + 0.25
                if await request.is_disconnected():
                    job.cancel.set()
            if event is None:
                continue
            if isinstance(event, Failed):
                error = event.error
                if isinstance(error, RequestError):  # already an HTTP answer (a remote engine's)
                    raise error
                if isinstance(error, PagelmError):
                    raise RequestError(str(error))
                raise internal_error(job.id)
            yield event
            if isinstance(event, Result):
                return
    finally:
        job.cancel.set()  # a no-op when finished; stops the engine when the consumer went away


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
               413: "invalid_request_error", 415: "invalid_request_error", 503: "server_overloaded"}


def internal_error(request_id: str | None = None) -> RequestError:
    """A server fault as the client sees it: no exception text, no paths (the log has them)."""
    which = f" (request {request_id})" if request_id else ""
    return RequestError(f"internal server error{which}; the server log has the details", status=500)


def error_response(e: RequestError, request: Request) -> JSONResponse:
    """The error in the shape of the protocol the request spoke: OpenAI's under /v1, else Ollama's."""
    if request.url.path.startswith("/v1"):
        body = {"error": {"message": str(e), "type": ERROR_TYPES.get(e.status, "server_error"), "param": e.param,
                          "code": e.code}}
    else:
        body = {"error": str(e)}
    return JSONResponse(body, status_code=e.status, headers=e.headers)

