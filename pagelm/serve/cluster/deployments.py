"""The Serve application: `PagelmEngine` (one pagelm engine per replica, the model mapped from
its path) behind `PagelmIngress` (the same routes as `pagelm serve`, over a ClusterServer).

The ingress renders prompts and checks requests with its own ChatModel (mapped, never computed
with), hands each Job to an engine replica chosen by the prefix-affinity router and streams its
events back. A request whose replica dies before it produced any text is sent again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
import weakref
from dataclasses import replace

import ray
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError

from pagelm.chat.model import ChatModel
from pagelm.errors import PagelmError
from pagelm.chat.grammar import Grammar
from pagelm.measure.memory import read_memory
from pagelm.serve.app import create_app
from pagelm.serve.core import Server, ServeSettings
from pagelm.serve.cluster.loopback import keep_replica_on_loopback
from pagelm.serve.cluster.wire import WireJob, prefix_hashes
from pagelm.serve.metrics import merge as merge_histograms
from pagelm.serve.requests import RequestError
from pagelm.serve.worker import Delta, Failed, Job, QueueFull, Result

log = logging.getLogger("pagelm.serve")
WAITING = 3  # requests a replica holds beyond its slots (waiting in its engine queue)
RESENDS = 4  # times a request not yet started is sent again after its replica died
STUCK_S = 300.0  # a running request with no event for this long fails the health check
RECENT = 256  # request ids each replica remembers having served (in /api/ps)
SUMMED = ("prefix_cache", "image_cache", "requests", "memory", "slots", "speculation")


def max_ongoing(settings: ServeSettings) -> int:
    """Requests one replica holds: one per slot (--parallel) and a few waiting."""
    return settings.parallel + WAITING


def _cpu_share() -> int:
    """Whole CPUs Ray gave this replica (its actor's num_cpus), at least 1."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    return max(1, int(cpus))


class PagelmEngine:
    """One engine replica: a Server (model, worker thread, prefix cache) without HTTP."""

    def __init__(self, settings: ServeSettings, stuck_s: float = STUCK_S):
        keep_replica_on_loopback()
        self.threads = settings.threads or _cpu_share()
        self.server = Server(replace(settings, threads=self.threads))
        self.server.load()
        if self.server.load_error is not None:
            raise PagelmError(f"could not load {settings.model_path}: {self.server.load_error}")
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()
        self.stuck_s = stuck_s
        self.last_event = time.monotonic()
        self.recent: collections.deque[str] = collections.deque(maxlen=RECENT)

    async def generate(self, wire: WireJob, prefix: list[str] = ()):
        """The Job's events (Delta…, then Result or Failed); cancelled when the caller goes away.
        `prefix` (the prompt's prefix hashes) is for the router, which reads it before this runs."""
        server = self.server
        try:
            grammar = None if wire.grammar is None else await server.grammar(*wire.grammar, "grammar")
            job = Job(wire.prompt(server.chat), wire.params, wire.stop, wire.max_len, wire.request_id, grammar)
            server.worker.submit(job)
        except (RequestError, PagelmError) as e:
            status = 503 if isinstance(e, QueueFull) else getattr(e, "status", 409)
            yield Failed(RequestError(str(e), status=status))
            return
        self.recent.append(job.id)
        self.last_event = time.monotonic()
        try:
            while True:
                event = await job.events.get()
                self.last_event = time.monotonic()
                yield event
                if isinstance(event, (Result, Failed)):
                    return
        finally:
            job.cancel.set()  # the ingress cancelled (client gone): the worker stops within a step

    def cancel(self, request_id: str) -> bool:
        return self.server.worker.cancel(request_id)

    def stats(self) -> dict:
        return {**self.server.stats(), "replica": self.replica, "node": self.node, "pid": os.getpid(),
                "threads": self.threads, "recent_requests": list(self.recent)}

    def check_health(self) -> None:
        worker = self.server.worker
        if not worker.alive:
            raise RuntimeError("the engine thread is dead")
        if worker.running is not None and time.monotonic() - self.last_event > self.stuck_s:
            raise RuntimeError(f"request {worker.running.id} has made no progress for {self.stuck_s:.0f} s")

    def __del__(self):
        if getattr(self, "server", None) is not None and self.server.worker is not None:
            self.server.worker.close()


class _CancelEvent(threading.Event):
    """A Job's cancel flag that also stops the remote call carrying it."""

    def __init__(self, on_set):
        super().__init__()
        self._on_set = on_set

    def set(self) -> None:
        if not self.is_set():
            super().set()
            self._on_set()


class RemoteWorker:
    """The ingress's stand-in for a Worker: each submitted Job runs on an engine replica."""

    def __init__(self, engine, limit: int):
        self.engine, self.limit = engine, limit
        self.grammars: weakref.WeakKeyDictionary[Grammar, tuple[str, str]] = weakref.WeakKeyDictionary()
        self._jobs: dict[str, Job] = {}
        self.resent = 0

    def submit(self, job: Job) -> None:
        if job.id in self._jobs:
            raise PagelmError(f"request id {job.id!r} is already in use")
        if len(self._jobs) >= self.limit:
            raise QueueFull(f"the request queue is full ({self.limit} in flight)")
        self._jobs[job.id] = job
        task = job.loop.create_task(self._relay(job))
        job.cancel = _CancelEvent(lambda: job.loop.call_soon_threadsafe(task.cancel))

    def cancel(self, request_id: str) -> bool:
        job = self._jobs.get(request_id)
        if job is not None:
            job.cancel.set()
        return job is not None

    def close(self) -> None:
        for job in list(self._jobs.values()):
            job.cancel.set()

    async def _relay(self, job: Job) -> None:
        wire = WireJob.of(job, None if job.grammar is None else self.grammars.get(job.grammar))
        hashes = prefix_hashes(job.prompt)
        stream = None
        try:
            for attempt in range(RESENDS + 1):
                started = False
                stream = self.engine.options(stream=True).generate.remote(wire, prefix=hashes)
                try:
                    async for event in stream:
                        started = started or isinstance(event, Delta)
                        job.events.put_nowait(event)
                        if isinstance(event, (Result, Failed)):
                            return
                    raise RequestError("the engine replica ended the stream without a result", status=500)
                except (RayActorError, ActorUnavailableError) as e:
                    if started or attempt == RESENDS:
                        raise RequestError(f"the engine replica serving this request failed: {e}", status=500) \
                            from None
                    self.resent += 1
                    log.warning("request %s: replica lost before it started (%s); sending it again", job.id, e)
                    await asyncio.sleep(0.2 * 2 ** attempt)
        except asyncio.CancelledError:
            if stream is not None:
                stream.cancel()
            raise
        except BackPressureError as e:
            job.events.put_nowait(Failed(RequestError(str(e), status=503, headers={"Retry-After": "2"})))
        except RequestError as e:
            job.events.put_nowait(Failed(e))
        except Exception as e:  # noqa: BLE001 - any failure of the call is this request's clean error
            log.exception("request %s failed in the cluster", job.id)
            job.events.put_nowait(Failed(RequestError(f"cluster error: {type(e).__name__}: {e}", status=500)))
        finally:
            self._jobs.pop(job.id, None)


class ClusterServer(Server):
    """The ingress's Server: prompts, grammars and checks here; generations on engine replicas."""

    def __init__(self, settings: ServeSettings, engine, replicas: int):
        super().__init__(replace(settings, prefix_slots=0))  # the cache lives in the replicas
        self.engine, self.replicas = engine, replicas

    def load(self) -> None:
        start = time.perf_counter()
        try:
            s = self.settings
            self.chat = ChatModel.open(s.model_path, name=s.model_name, embedding=s.embedding, weights=s.weights,
                                       dtype=s.dtype, threads=1, mmproj=s.mmproj, image_cache_mib=0,
                                       image_tokens=s.image_tokens)
            self.worker = RemoteWorker(self.engine, s.queue_size + self.replicas * max_ongoing(s))
        except Exception as e:  # noqa: BLE001 - reported by /health
            self.load_error = e
        self.load_s = time.perf_counter() - start
        self.on_load(self.load_error)

    async def grammar(self, kind: str, text: str, param: str) -> Grammar:
        grammar = await super().grammar(kind, text, param)
        self.worker.grammars[grammar] = (kind, text)  # what the replica compiles it from
        return grammar

    async def current_stats(self) -> dict:
        """Each replica's figures (`replicas`) and their sums; the ingress's own memory apart."""
        answers = await self.engine.broadcast("stats").results_async(timeout_s=30, return_exceptions=True)
        replicas = sorted((a for a in answers if isinstance(a, dict)), key=lambda r: r["replica"])
        totals = {group: {} for group in SUMMED}
        for r in replicas:
            for group in SUMMED:
                for key, value in r[group].items():
                    if isinstance(value, (bool, int, float)):
                        totals[group][key] = totals[group].get(key, 0) + value
        memory = read_memory()
        return {**totals, "histograms": merge_histograms([r.get("histograms", {}) for r in replicas]),
                "replicas": replicas, "unreachable_replicas": len(answers) - len(replicas),
                "ingress": {"resent": self.worker.resent if self.worker else 0,
                            "memory": {"anonymous_bytes": memory.anonymous, "rss_bytes": memory.rss}}}


@serve.ingress()
class PagelmIngress:
    def __init__(self, settings: ServeSettings, engine, replicas: int):
        keep_replica_on_loopback()
        self.server = ClusterServer(settings, engine, replicas)
        self.settings = settings

    def __serve_build_asgi_app__(self):
        return create_app(self.settings, server=self.server)


def build_app(settings: ServeSettings, replicas: int, num_cpus: float, routing: str = "prefix",
              stuck_s: float = STUCK_S):
    """The bound application: `replicas` engines of `num_cpus` each behind one ingress."""
    router = RequestRouterConfig(request_router_class="pagelm.serve.cluster.router:PrefixAffinityRouter",
                                 request_router_kwargs={"policy": routing})
    engine = serve.deployment(
        PagelmEngine, name="PagelmEngine", num_replicas=replicas, max_ongoing_requests=max_ongoing(settings),
        ray_actor_options={"num_cpus": num_cpus}, request_router_config=router,
        graceful_shutdown_timeout_s=30, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=5, health_check_timeout_s=30)
    ingress = serve.deployment(PagelmIngress, name="PagelmIngress", num_replicas=1,
                               max_ongoing_requests=settings.queue_size + replicas * max_ongoing(settings),
                               ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=30)
    return ingress.bind(settings, engine.bind(settings, stuck_s), replicas)


def app_builder(args: dict):
    """The application for a Serve config file (`import_path: pagelm.serve.cluster.deployments:app_builder`):
    `args` are `model` (a path on every node), optional `name`, `replicas` (default 1), `num_cpus`
    per replica (default 1), `routing` (prefix | random) and any ServeSettings field (ctx_len, …)."""
    args = dict(args)
    model = os.path.abspath(args.pop("model"))
    replicas, num_cpus = int(args.pop("replicas", 1)), float(args.pop("num_cpus", 1))
    routing = args.pop("routing", "prefix")
    if "image_tokens" in args:
        args["image_tokens"] = tuple(args["image_tokens"])
    settings = ServeSettings(model_path=model, model_name=args.pop("name", os.path.splitext(os.path.basename(model))[0]),
                             **args)
    return build_app(settings, replicas, num_cpus, routing)
