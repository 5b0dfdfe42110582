"""`pagelm bench concurrency`: one `pagelm serve --parallel` process driven by 1, 2, 4, 8… concurrent
streaming clients over loopback, answers compared with those of one client (the request alone).

Owns the load (seeded prompts, client threads, a long prompt arriving while 4 streams decode, the
memory of busy slots against idle ones) and its report; the server process is bench.server's.
With a `llama-server` binary on PATH, the same clients run against `llama-server -np N` too.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from pagelm.bench.inputs import text_of_tokens
from pagelm.bench.report import Panel, bar_chart, machine_description, markdown_table
from pagelm.bench.server import ServerConfig, ServerProcess, free_port, progress
from pagelm.errors import PagelmError

LONG_PROMPT_TOKENS = 2600
STREAMS = 4  # decoding while the long prompt arrives
WARM_TOKENS, WINDOW_TOKENS = 8, 24  # per stream: skipped, then the inter-token gaps measured before it
SLOT_SLACK_MIB = 4  # what a busy slot may hold beyond its state (the bound)
MIB = 1 << 20


@dataclass
class Answer:
    """One streamed completion as a client saw it."""

    text: str = ""
    tokens: int = 0
    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # when each piece of text came

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent if self.arrivals else float("nan")

    @property
    def gaps(self) -> list[float]:
        return list(np.diff(self.arrivals))


def model_id(target: ServerProcess) -> str:
    return target.get("/v1/models").body["data"][0]["id"]


def complete(target: ServerProcess, prompt: str, new_tokens: int, answer: Answer | None = None,
             stop: threading.Event | None = None) -> Answer:
    """A greedy streamed /v1/completions of `prompt`; `stop`, once set, ends it (the connection closes)."""
    answer = answer or Answer()
    body = {"model": target.model_id, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    answer.sent = time.perf_counter()
    stream = target.stream("/v1/completions", body)
    if stream.status != 200:
        raise PagelmError(f"/v1/completions answered {stream.status}")
    try:
        for event in stream.events:
            now = time.perf_counter()
            text = "".join(c.get("text") or "" for c in event.get("choices") or [])
            if text:
                answer.text += text
                answer.arrivals.append(now)
            if event.get("usage"):
                answer.tokens = event["usage"]["completion_tokens"]
            if stop is not None and stop.is_set():
                break
    finally:
        stream.close()
    answer.tokens = answer.tokens or len(answer.arrivals)
    return answer


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


@dataclass
class Level:
    """One concurrency level's figures."""

    clients: int
    answers: list[Answer]
    wall_s: float
    queue_wait_s: float | None  # mean, from the server's histogram (pagelm only)
    differing: int = 0
    engine: dict[str, tuple[float, int]] = field(default_factory=dict)  # histogram: (seconds, count) in the level

    @property
    def tokens_per_s(self) -> float:
        return sum(a.tokens for a in self.answers) / self.wall_s

    def ttft(self, q: float) -> float:
        return _percentile([a.ttft for a in self.answers], q)

    def itl(self, q: float) -> float:
        return _percentile([g for a in self.answers for g in a.gaps], q)


ENGINE_HISTOGRAMS = ("queue_wait_seconds", "decode_step_seconds", "prefill_segment_seconds")


def _engine_sums(target: ServerProcess) -> dict[str, tuple[float, int]]:
    """(sum, count) of the server's engine histograms (pagelm only)."""
    if isinstance(target, LlamaServer):
        return {}
    found = target.stats().get("histograms", {})
    return {name: (found[name]["sum"], found[name]["count"]) for name in ENGINE_HISTOGRAMS if name in found}


def run_level(target: ServerProcess, prompts: list[str], new_tokens: int, clients: int) -> Level:
    """Every prompt once, `clients` at a time, in order."""
    answers: list[Answer | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))
    lock = threading.Lock()
    failures: list[Exception] = []

    def client() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None or failures:
                return
            try:
                answers[i] = complete(target, prompts[i], new_tokens)
            except Exception as e:  # noqa: BLE001 - reported after the level
                failures.append(e)

    before = _engine_sums(target)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for _ in range(clients):
            pool.submit(client)
    wall = time.perf_counter() - start
    if failures:
        raise PagelmError(f"{clients} clients: a request failed: {failures[0]}")
    after = _engine_sums(target)
    engine = {name: (after[name][0] - before[name][0], after[name][1] - before[name][1])
              for name in after if name in before}
    wait = engine.get("queue_wait_seconds", (0.0, 0))
    return Level(clients, answers, wall, wait[0] / wait[1] if wait[1] else None, engine=engine)


@dataclass
class LongPrompt:
    """Inter-token gaps of the streams before the long prompt came and while it was prefilled."""

    before: list[float]
    during: list[float]
    prefill_s: float

    @property
    def ratio(self) -> float:
        return _percentile(self.during, 95) / _percentile(self.before, 95)


def run_long_prompt(target: ServerProcess, prompts: list[str], long_prompt: str) -> LongPrompt:
    """STREAMS streams decode; once each has WARM + WINDOW tokens the long prompt is sent (one token)."""
    if len(prompts) < STREAMS:
        raise PagelmError(f"{STREAMS} streams need {STREAMS} prompts, got {len(prompts)}")
    stop = threading.Event()
    answers = [Answer() for _ in range(STREAMS)]
    threads = [threading.Thread(target=complete, args=(target, p, 100_000, a, stop), daemon=True)
               for p, a in zip(prompts[:STREAMS], answers)]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + 1800
    while min(len(a.arrivals) for a in answers) < WARM_TOKENS + WINDOW_TOKENS:
        if time.perf_counter() > deadline or not all(t.is_alive() for t in threads):
            stop.set()
            raise PagelmError("the streams did not reach their measuring window")
        time.sleep(0.05)
    window_start = max(a.arrivals[WARM_TOKENS] for a in answers)
    sent = time.perf_counter()
    complete(target, long_prompt, 1)
    done = time.perf_counter()
    stop.set()
    for t in threads:
        t.join(timeout=600)

    def gaps(lo: float, hi: float) -> list[float]:
        return [b - a for ans in answers for a, b in zip(ans.arrivals, ans.arrivals[1:]) if lo < b <= hi]

    return LongPrompt(gaps(window_start, sent), gaps(sent, done), done - sent)


@dataclass
class SlotMemory:
    """Anonymous memory of the server with its slots busy, idle, and the state of one slot."""

    busy_slots: int
    busy_bytes: int
    idle_bytes: int
    slot_state_bytes: int

    @property
    def grown(self) -> int:
        return self.busy_bytes - self.idle_bytes

    @property
    def bound(self) -> int:
        return self.busy_slots * (self.slot_state_bytes + SLOT_SLACK_MIB * MIB)


class MemorySampler:
    """Polls /api/ps while a level runs: the most anonymous memory seen with the most slots busy."""

    def __init__(self, target: ServerProcess):
        self.target, self.busy, self.anonymous, self.state = target, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            ps = self.target.stats()
            busy, anonymous = ps["slots"]["busy"], ps["memory"]["anonymous_bytes"]
            self.state = max(self.state, *ps["slots"]["per_slot_state_bytes"])
            if (busy, anonymous) > (self.busy, self.anonymous):
                self.busy, self.anonymous = busy, anonymous
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _idle_memory(target: ServerProcess) -> int:
    deadline = time.perf_counter() + 120
    while target.stats()["slots"]["working"]:
        if time.perf_counter() > deadline:
            raise PagelmError("the server did not go idle")
        time.sleep(0.1)
    return target.stats()["memory"]["anonymous_bytes"]


class LlamaServer(ServerProcess):
    """`llama-server -np N` on the same file, for comparison (same wire: /health, /v1/completions),
    its prompt caches off as pagelm's prefix cache is: a level after the first would otherwise find
    every prompt already processed."""

    def __init__(self, model_path: str, parallel: int, ctx_len: int, threads: int, extra_flags: tuple[str, ...] = ()):
        self.model_path, self.config = model_path, ServerConfig()
        self.port = free_port()
        self._log = tempfile.TemporaryFile(mode="w+")
        command = [shutil.which("llama-server"), "-m", model_path, "--host", "127.0.0.1", "--port", str(self.port),
                   "-np", str(parallel), "-c", str(ctx_len * parallel), "-t", str(threads),
                   "--no-cache-prompt", "--cache-ram", "0", *extra_flags]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self._log)
        self.load_s = 0.0


@dataclass
class ConcurrencyReport:
    model: str
    command: str
    threads: int
    parallel: int
    prompt_tokens: tuple[int, int]
    new_tokens: int
    levels: list[Level]
    long_prompt: LongPrompt | None
    memory: SlotMemory | None
    llama_levels: list[Level] = field(default_factory=list)
    machine: str = field(default_factory=machine_description)

    @property
    def differing(self) -> int:
        return sum(level.differing for level in self.levels)

    def _rows(self, levels: list[Level], server: str) -> list[list]:
        one = levels[0].tokens_per_s
        ms = lambda s: "–" if s is None or s != s else f"{s * 1000:.0f}"  # noqa: E731 - nan is not equal to itself
        return [[server, lv.clients, len(lv.answers), sum(a.tokens for a in lv.answers), f"{lv.tokens_per_s:.1f}",
                 f"{lv.tokens_per_s / one:.2f}×", ms(lv.ttft(50)), ms(lv.ttft(95)), ms(lv.itl(50)), ms(lv.itl(95)),
                 ms(lv.queue_wait_s), lv.differing if server == "pagelm" else "–"]
                for lv in levels]

    def markdown(self) -> str:
        lo, hi = self.prompt_tokens
        lines = [f"`{self.command}`", "",
                 f"{self.model}: `pagelm serve --parallel {self.parallel} --threads {self.threads}`, prompts of "
                 f"{lo}–{hi} tokens, {self.new_tokens} new tokens each (greedy, streamed /v1/completions), on "
                 f"{self.machine}", ""]
        rows = self._rows(self.levels, "pagelm") + (self._rows(self.llama_levels, "llama-server")
                                                     if self.llama_levels else [])
        lines.append(markdown_table(
            ["server", "clients", "requests", "tokens", "aggregate tok/s", "× 1 client", "TTFT p50 ms",
             "TTFT p95 ms", "inter-token p50 ms", "inter-token p95 ms", "queue wait ms (mean)", "differing"],
            rows, "llrrrrrrrrrr"))
        lines.append("")
        for lv in self.levels[1:]:
            lines.append(f"clients {lv.clients}: {lv.tokens_per_s / self.levels[0].tokens_per_s:.2f}× 1 client")
        for lv in self.levels:
            (decode_s, steps), (prefill_s, segments) = (lv.engine.get("decode_step_seconds", (0.0, 0)),
                                                       lv.engine.get("prefill_segment_seconds", (0.0, 0)))
            if steps or segments:
                tokens = sum(a.tokens for a in lv.answers)
                lines.append(f"engine, {lv.clients} client(s): {steps} decode steps ({tokens / max(steps, 1):.2f} "
                             f"completion tokens per step) {decode_s:.1f} s ({decode_s / max(steps, 1) * 1000:.0f} ms each), "
                             f"{segments} prefill segments {prefill_s:.1f} s "
                             f"({prefill_s / max(segments, 1) * 1000:.0f} ms each), other "
                             f"{lv.wall_s - decode_s - prefill_s:.1f} s of {lv.wall_s:.1f} s")
        if not self.llama_levels:
            lines.append("llama-server: not on PATH, not compared")
        if self.long_prompt is not None:
            lp = self.long_prompt
            lines.append(f"long prompt ({LONG_PROMPT_TOKENS} tokens, prefilled in {lp.prefill_s:.1f} s) while "
                         f"{STREAMS} streams decode: inter-token p95 {_percentile(lp.before, 95) * 1000:.0f} ms "
                         f"before, {_percentile(lp.during, 95) * 1000:.0f} ms during ({lp.ratio:.2f}×)")
        if self.memory is not None:
            m = self.memory
            lines.append(f"memory: {m.busy_slots} busy slots − idle = {m.grown / MIB:.1f} MiB anonymous "
                         f"(bound {m.busy_slots} × (slot state {m.slot_state_bytes / MIB:.1f} MiB + "
                         f"{SLOT_SLACK_MIB} MiB) = {m.bound / MIB:.1f} MiB)")
        lines.append(f"differing answers: {self.differing} of {sum(len(lv.answers) for lv in self.levels[1:])}")
        return "\n".join(lines)

    def chart(self, path: str) -> str:
        categories = [str(lv.clients) for lv in self.levels]

        def series(figure) -> dict[str, list[float]]:
            out = {"pagelm": [figure(lv) for lv in self.levels]}
            if self.llama_levels:
                out["llama-server"] = [figure(lv) for lv in self.llama_levels]
            return out

        panels = [Panel("aggregate completion tok/s", "tok/s", categories, series(lambda lv: lv.tokens_per_s)),
                  Panel("time to first token p95", "ms", categories, series(lambda lv: lv.ttft(95) * 1000)),
                  Panel("inter-token latency p95", "ms", categories, series(lambda lv: lv.itl(95) * 1000))]
        return bar_chart(path, panels, f"{self.model}: concurrent clients (x axis), {self.threads} threads")


def run_concurrency(name: str, path: str, command: str, clients: list[int], requests: int,
                    prompt_tokens: tuple[int, int], new_tokens: int, threads: int,
                    long_prompt: bool = True) -> ConcurrencyReport:
    clients = sorted(set(clients) | {1})  # one client: the request alone, what the others are compared with
    parallel = max(max(clients), STREAMS + 1 if long_prompt else 1)
    rng = np.random.default_rng(0)
    lengths = rng.integers(prompt_tokens[0], prompt_tokens[1] + 1, size=requests)
    prompts = [text_of_tokens(path, int(n), seed=i) for i, n in enumerate(lengths)]
    ctx_len = max(4096, LONG_PROMPT_TOKENS + 64, prompt_tokens[1] + new_tokens + 8)
    config = ServerConfig(prefix_cache=False, ctx_len=ctx_len)  # every level prefills every prompt
    flags = ["--parallel", str(parallel), "--threads", str(threads), "--queue-size", str(max(64, requests))]
    levels: list[Level] = []
    memory = None
    with ServerProcess(path, config, flags) as server:
        server.model_id = model_id(server)
        for c in clients:
            progress(f"{name}: {c} client(s), {requests} requests")
            sampler = MemorySampler(server) if c == clients[-1] else None
            level = run_level(server, prompts, new_tokens, c)
            if sampler is not None:
                sampler.stop()
                memory = SlotMemory(sampler.busy, sampler.anonymous, _idle_memory(server), sampler.state)
            if levels:
                level.differing = sum(a.text != b.text or a.tokens != b.tokens
                                      for a, b in zip(level.answers, levels[0].answers))
            levels.append(level)
            progress(f"{name}: {c} client(s): {level.tokens_per_s:.2f} tok/s, TTFT p95 {level.ttft(95):.2f} s, "
                     f"inter-token p95 {level.itl(95):.3f} s, {level.differing} differing")
        long_run = None
        if long_prompt:
            progress(f"{name}: a {LONG_PROMPT_TOKENS}-token prompt while {STREAMS} streams decode")
            streams = prompts + [text_of_tokens(path, int(lengths[0]), seed=i) for i in range(len(prompts), STREAMS)]
            long_run = run_long_prompt(server, streams, text_of_tokens(path, LONG_PROMPT_TOKENS, seed=10_000))
    llama_levels = []
    if shutil.which("llama-server"):
        with LlamaServer(path, max(clients), ctx_len, threads) as llama:
            llama.model_id = model_id(llama)
            for c in clients:
                progress(f"{name}: llama-server, {c} client(s)")
                llama_levels.append(run_level(llama, prompts, new_tokens, c))
    return ConcurrencyReport(name, command, threads, parallel, prompt_tokens, new_tokens, levels, long_run, memory,
                             llama_levels)
