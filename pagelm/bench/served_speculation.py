"""`pagelm bench speculate --parallel N`: `pagelm serve --parallel N` with speculation off and on (`auto`, the
default), N clients at once each asking for an *edit* (the same function, a different name each), greedy:
aggregate completion tokens per second, whether any answer differs, and the anonymous memory the speculating
slots add (the most seen with every slot busy, speculating minus not).

Owns the requests and the measurement; the server is `pagelm serve`'s, in a process of its own.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

from pagelm.bench.concurrency import MemorySampler, model_id
from pagelm.bench.server import ServerConfig, ServerProcess, progress
from pagelm.errors import PagelmError

MIB = 1 << 20
# what each client's edit renames `cur_line` to (bench.speculate's edit task renames it to current_line)
NEW_NAMES = ("current_line", "line_now", "this_line", "line_so_far", "open_line", "pending_line", "line_built",
             "partial_line")
MODES = ("off", "auto")


@dataclass
class Served:
    """One server's runs: aggregate tokens per second, the answers (run by run, client by client), and the most
    anonymous memory seen with every slot busy."""

    mode: str
    tok_s: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    busy_anonymous: int = 0


@dataclass
class ServedReport:
    parallel: int
    tokens: int
    plain: Served
    speculative: Served

    @property
    def differing(self) -> int:
        return sum(a != b for a, b in zip(self.plain.answers, self.speculative.answers))

    def lines(self) -> list[str]:
        plain, spec = (statistics.median(s.tok_s) for s in (self.plain, self.speculative))
        extra = (self.speculative.busy_anonymous - self.plain.busy_anonymous) / self.parallel / MIB
        return [f"### `pagelm serve --parallel {self.parallel}`, {self.parallel} clients at once on the edit task "
                f"({self.tokens} tokens each, medians of {len(self.plain.tok_s)} runs)", "",
                f"aggregate tok/s: speculate off {plain:.1f}, auto {spec:.1f} ({spec / plain:.2f}×)",
                f"extra anonymous memory per speculating sequence: {extra:.1f} MiB "
                f"(busy: {self.plain.busy_anonymous / MIB:.0f} MiB off, {self.speculative.busy_anonymous / MIB:.0f} "
                f"MiB auto)",
                f"served answers differing with speculation: {self.differing} of {len(self.speculative.answers)}"]


def edit_messages(code: str, parallel: int) -> list[str]:
    return [f"Rewrite this Python function with the variable `cur_line` renamed to `{name}`. Answer with the whole "
            f"function and nothing else.\n\n```python\n{code}```" for name in NEW_NAMES[:parallel]]


def _ask(server: ServerProcess, message: str, tokens: int, out: list, i: int) -> None:
    reply = server.post("/v1/chat/completions", {"model": server.model_id, "max_tokens": tokens, "temperature": 0,
                                                 "messages": [{"role": "user", "content": message}]})
    if reply.status != 200:
        raise PagelmError(f"/v1/chat/completions answered {reply.status}: {reply.body}")
    out[i] = (reply.body["choices"][0]["message"]["content"], reply.body["usage"]["completion_tokens"])


def _serve(path: str, mode: str, messages: list[str], tokens: int, runs: int) -> Served:
    served = Served(mode)
    flags = ["--parallel", str(len(messages)), "--speculate", mode]
    with ServerProcess(path, ServerConfig(prefix_cache=False), flags) as server:
        server.model_id = model_id(server)
        _ask(server, "Say hello.", 4, [None], 0)  # warm
        for run in range(runs):
            progress(f"serve --parallel {len(messages)} --speculate {mode}: run {run + 1} of {runs}")
            out = [None] * len(messages)
            clients = [threading.Thread(target=_ask, args=(server, m, tokens, out, i)) for i, m in enumerate(messages)]
            sampler = MemorySampler(server)
            began = time.perf_counter()
            for client in clients:
                client.start()
            for client in clients:
                client.join()
            seconds = time.perf_counter() - began
            sampler.stop()
            if any(o is None for o in out):
                raise PagelmError(f"a request to the --speculate {mode} server failed")
            served.tok_s.append(sum(n for _, n in out) / seconds)
            served.answers += [text for text, _ in out]
            if sampler.busy == len(messages):
                served.busy_anonymous = max(served.busy_anonymous, sampler.anonymous)
    return served


def run_served(path: str, code: str, parallel: int, tokens: int, runs: int) -> ServedReport:
    messages = edit_messages(code, parallel)
    plain, spec = (_serve(path, mode, messages, tokens, runs) for mode in MODES)
    return ServedReport(parallel, tokens, plain, spec)
