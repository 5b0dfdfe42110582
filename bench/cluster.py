"""Benchmark: pagelm on Ray Serve (pagelm.serve.cluster) against one plain `pagelm serve`.

On a local Ray (dashboard off) with the CPUs of this machine, deployed in process with
`build_app`: throughput (requests/s, generated tokens/s) at concurrency 1, 2, 4, 8 for 1 replica
(all CPUs) vs 2 (half each); the latency a request gains over a plain `pagelm serve` with the same
threads; memory: each engine replica's pages of the model file (RSS and PSS: two replicas share
them) beside two plain servers', and Ray's own processes; the prefix-cache hit rate of 3 clients
× a 4-turn chat with prefix affinity vs random routing. Greedy, thinking off, short answers.

    python bench/cluster.py [--model bench/models/qwen3.5-0.8b-q8_0.gguf] [--tokens 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from pagelm.bench.server import ServerConfig, ServerProcess, free_port
from pagelm.bench.shared import measure_pair, model_file_pages
from pagelm.measure.memory import read_memory
from pagelm.serve.core import ServeSettings
from pagelm.serve.cluster.loopback import LOOPBACK_ENV, start_local_ray

MIB = 1 << 20
CONCURRENCY = (1, 2, 4, 8)
TOPICS = ["rivers", "volcanoes", "owls"]
RAY_PROCESSES = ("gcs_server", "raylet", "ServeController", "ProxyActor", "PagelmIngress", "log_monitor",
                 "dashboard", "runtime_env", "ray::IDLE", "monitor.py")


class Endpoint:
    """An HTTP server of pagelm's routes (a plain one or the cluster's proxy)."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model

    def chat(self, messages: list[dict], tokens: int) -> dict:
        r = httpx.post(f"{self.url}/v1/chat/completions", timeout=900,
                       json={"model": self.model, "messages": messages, "max_tokens": tokens, "temperature": 0,
                             "chat_template_kwargs": {"enable_thinking": False}})
        r.raise_for_status()
        return r.json()

    def ps(self) -> dict:
        return httpx.get(f"{self.url}/api/ps", timeout=60).json()


def throughput(endpoint: Endpoint, concurrency: int, tokens: int) -> tuple[float, float]:
    """(requests/s, generated tokens/s) of max(4, concurrency) distinct requests, `concurrency` at a time."""
    n = max(4, concurrency)
    pending, generated, lock = list(range(n)), [], threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not pending:
                    return
                i = pending.pop()
            reply = endpoint.chat([{"role": "user", "content": f"Request {i} at {time.time()}: describe a town."}],
                                  tokens)
            with lock:
                generated.append(reply["usage"]["completion_tokens"])

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    return n / elapsed, sum(generated) / elapsed


def latency(endpoint: Endpoint, runs: int, tokens: int) -> float:
    """Median seconds of one short request, alone."""
    endpoint.chat([{"role": "user", "content": "Warm up."}], tokens)
    times = []
    for i in range(runs):
        start = time.perf_counter()
        endpoint.chat([{"role": "user", "content": f"Latency probe {i}: say hello."}], tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hit_rate(endpoint: Endpoint, tokens: int) -> tuple[int, int]:
    """(turns 2-4 with prefix-cache hits, turns 2-4) of 3 concurrent 4-turn chats."""
    hits = []

    def chat(c: int) -> None:
        messages = []
        for t in range(4):
            messages.append({"role": "user", "content": f"Chat {c} ({time.time()}), turn {t}: about {TOPICS[c]}?"})
            reply = endpoint.chat(messages, tokens)
            if t:
                hits.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0)
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})

    threads = [threading.Thread(target=chat, args=(c,)) for c in range(len(TOPICS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(hits), len(hits)


def ray_memory() -> dict[str, float]:
    """PSS in MiB of Ray's own processes on this node (not the engine replicas), by kind."""
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            kind = next((k for k in RAY_PROCESSES if k in cmdline), None)
            if kind is None or "PagelmEngine" in cmdline:
                continue
            snapshot = read_memory(int(pid))
        except Exception:  # noqa: BLE001 - a process that ended (or is not ours) while we looked
            continue
        out[kind] = out.get(kind, 0.0) + ((snapshot.pss_anon or 0) + (snapshot.pss_file or 0)) / MIB
    return out


def file_mappers(path: str, replicas: dict[int, str]) -> list[tuple[str, float, float]]:
    """(who, RSS MiB, PSS MiB) of every process on this node with pages of the model file mapped:
    the replicas by id, any other by its command line, which says who else is charged a share."""
    out = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            rss, pss = model_file_pages(pid, path)
            if rss == 0:
                continue
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # a process that ended (or is not ours) while we looked
            continue
        who = f"replica {replicas[pid]}" if pid in replicas else f"pid {pid}: {cmdline.strip()[:60]}"
        out.append((who, rss / MIB, pss / MIB))
    return sorted(out)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench/models/qwen3.5-0.8b-q8_0.gguf")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer (default 16)")
    parser.add_argument("--latency-runs", type=int, default=5)
    args = parser.parse_args()
    os.environ.update(LOOPBACK_ENV)  # before ray is imported
    import ray
    from ray import serve

    from pagelm.serve.cluster import APP_NAME
    from pagelm.serve.cluster.deployments import build_app

    path = os.path.abspath(args.model)
    name = Path(path).stem
    cpus = os.cpu_count() or 1
    settings = ServeSettings(model_path=path, model_name=name, ctx_len=2048)

    print(f"plain pagelm serve ({cpus} threads) ...", file=sys.stderr, flush=True)
    with ServerProcess(path, ServerConfig(ctx_len=2048), ["--threads", str(cpus)]) as plain:
        plain_latency = latency(Endpoint(f"http://127.0.0.1:{plain.port}", name), args.latency_runs, args.tokens)
    print("two plain pagelm serve processes (shared pages) ...", file=sys.stderr, flush=True)
    plain_first, plain_second = measure_pair(path, "all mapped")

    start_local_ray(num_cpus=cpus)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    endpoint = Endpoint(f"http://127.0.0.1:{port}", name)
    results, hits, memory = {}, {}, {}
    try:
        for replicas in (1, 2):
            print(f"{replicas} replica(s) ...", file=sys.stderr, flush=True)
            # a new size is a new application: an update would wait for CPUs the old replicas hold
            serve.delete(APP_NAME)
            serve.run(build_app(settings, replicas, max(1, cpus // replicas)), name=APP_NAME, route_prefix="/")
            endpoint.chat([{"role": "user", "content": "Warm up."}], args.tokens)
            if replicas == 1:
                cluster_latency = latency(endpoint, args.latency_runs, args.tokens)
            results[replicas] = {c: throughput(endpoint, c, args.tokens) for c in CONCURRENCY}
            if replicas == 2:
                hits["prefix affinity"] = hit_rate(endpoint, 8)
                for r in endpoint.ps()["replicas"]:
                    rss, pss = model_file_pages(r["pid"], path)
                    memory[r["replica"]] = (rss / MIB, pss / MIB, r["memory"]["anonymous_bytes"] / MIB,
                                            r["prefix_cache"]["bytes_held"] / MIB)
                mappers = file_mappers(path, {r["pid"]: r["replica"] for r in endpoint.ps()["replicas"]})
                ray_own = ray_memory()
        print("2 replicas, random routing ...", file=sys.stderr, flush=True)
        serve.delete(APP_NAME)
        serve.run(build_app(settings, 2, max(1, cpus // 2), routing="random"), name=APP_NAME, route_prefix="/")
        endpoint.chat([{"role": "user", "content": "Warm up."}], args.tokens)
        hits["random"] = hit_rate(endpoint, 8)
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"\nmodel {path}, {args.tokens} tokens per answer, {cpus} CPUs, greedy, thinking off\n")
    rows = [[c] + [f"{results[n][c][k]:.2f}" for n in (1, 2) for k in (0, 1)] for c in CONCURRENCY]
    print(table(["concurrency", "1 replica req/s", "1 replica tok/s", "2 replicas req/s", "2 replicas tok/s"], rows))
    print()
    print(table(["one short request, alone", "seconds"],
                [["plain pagelm serve", f"{plain_latency:.3f}"], ["cluster, 1 replica", f"{cluster_latency:.3f}"],
                 ["added by Ray Serve", f"{cluster_latency - plain_latency:+.3f}"]]))
    print()
    rows = [[f"replica {rid}", f"{rss:.0f}", f"{pss:.0f}", f"{anon:.0f}", f"{cache:.0f}"]
            for rid, (rss, pss, anon, cache) in memory.items()]
    rows += [[f"plain pagelm serve {i} (one chat)", f"{f['model_rss']:.0f}", f"{f['model_pss']:.0f}",
              f"{f['anonymous']:.0f}", ""] for i, f in ((1, plain_first), (2, plain_second))]
    print(table(["process", "model file RSS MiB", "model file PSS MiB", "anonymous MiB", "of which prefix cache"],
                rows))
    print()
    print(table(["every process mapping the model file (2 replicas)", "RSS MiB", "PSS MiB"],
                [[who, f"{rss:.0f}", f"{pss:.0f}"] for who, rss, pss in mappers]))
    print()
    print(table(["Ray process (this node)", "PSS MiB"],
                [[k, f"{v:.0f}"] for k, v in sorted(ray_own.items())] + [["total", f"{sum(ray_own.values()):.0f}"]]))
    print()
    print(table(["routing (2 replicas, 3 chats x 4 turns)", "turns 2-4 with a prefix hit", "hit rate"],
                [[k, f"{h} of {n}", f"{h / n:.0%}"] for k, (h, n) in hits.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
