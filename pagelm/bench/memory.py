"""`pagelm bench memory`: what the embedding and weights modes cost a serving process, side by
side (everything unpacked; embedding mapped; everything mapped): anonymous memory after one chat
and its parts (weights, tokenizer, decode state, prefix cache, the rest = runtime), file-backed
RSS, peak RSS, TTFT of a 2,600-token prompt and decode speed.

Owns that measurement; one fresh `pagelm serve` per model, mode and run (allocators keep what
they freed, so a process measures one configuration only).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from pagelm.bench.inputs import MIB, display_name, embedding_table_mib, text_of_tokens
from pagelm.bench.report import Panel, bar_chart, markdown_table
from pagelm.bench.server import ServerConfig, ServerProcess, mmproj_flags, progress
from pagelm.errors import PagelmError

# label -> (embedding, weights)
MODES = {"all dense": ("dense", "dense"), "embedding mapped": ("mapped", "dense"), "all mapped": ("mapped", "mapped")}
DEFAULT_MODELS = ("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "smollm2-135m", "gemma3-270m")
FIRST_CHAT = [{"role": "user", "content": "Hello! In one sentence, what can you do?"}]


def measure_once(model_path: str, mode: str, long_text: str, prompt_tokens: int, new_tokens: int,
                 mmproj: str | None = None) -> dict:
    """One fresh server (with the vision tower `mmproj`, if given): a short chat, memory, then the
    long prompt (server-side timings)."""
    ctx_len = max(4096, prompt_tokens + new_tokens + 256)  # 256: the chat template's own tokens, with room
    embedding, weights = MODES[mode]
    config = ServerConfig(embedding=embedding, ctx_len=ctx_len, weights=weights)
    with ServerProcess(model_path, config, mmproj_flags(mmproj)) as server:
        name = Path(model_path).stem  # the name `pagelm serve` gives a file
        options = {"temperature": 0, "num_predict": 32}
        chat = server.post("/api/chat", {"model": name, "messages": FIRST_CHAT, "stream": False, "think": False,
                                         "options": options})
        if chat.status != 200:
            raise PagelmError(f"chat on {name} failed: HTTP {chat.status} {chat.body}")
        after_chat = server.memory()
        ps = server.get("/api/ps").body
        parts = ps["memory"]
        long = server.post("/api/chat", {"model": name, "stream": False, "think": False,
                                         "messages": [{"role": "user", "content": long_text}],
                                         "options": {"temperature": 0, "num_predict": new_tokens}})
        if long.status != 200:
            raise PagelmError(f"long prompt on {name} failed: HTTP {long.status} {long.body}")
        end = server.memory()
        body = long.body
        decoded = body["eval_count"] - 1  # the first token's step belongs to TTFT (prompt_eval_duration)
        return {"load_s": server.load_s, "anon_mib": after_chat.anonymous / MIB,
                "cache_mib": ps["prefix_cache"]["bytes_held"] / MIB,
                "weights_mib": parts["weights_anonymous_bytes"] / MIB,
                "tokenizer_mib": parts["tokenizer_anonymous_bytes"] / MIB, "state_mib": parts["state_bytes"] / MIB,
                "file_rss_mib": after_chat.file_rss / MIB, "peak_rss_mib": end.peak_rss / MIB,
                "ttft_s": body["prompt_eval_duration"] / 1e9,
                "decode_tok_s": decoded / (body["eval_duration"] / 1e9) if decoded > 0 else float("nan"),
                "prompt_tokens": body["prompt_eval_count"] + body["prompt_cached_count"],
                "cached_tokens": body["prompt_cached_count"], "new_tokens": body["eval_count"]}


@dataclass
class ModelMemory:
    model: str
    table_mib: float
    runs: dict[str, list[dict]] = field(default_factory=lambda: {mode: [] for mode in MODES})

    def median(self, mode: str, key: str) -> float:
        return statistics.median(r[key] for r in self.runs[mode])

    def saving_line(self) -> str:
        def ratio(key: str, a: str, b: str) -> float:
            return self.median(a, key) / self.median(b, key)

        table = self.median("all dense", "anon_mib") - self.median("embedding mapped", "anon_mib")
        layers = self.median("embedding mapped", "anon_mib") - self.median("all mapped", "anon_mib")
        runs = {mode: [round(r["ttft_s"], 2) for r in self.runs[mode]] for mode in MODES}
        return (f"{self.model}: mapping the embedding saves {table:.0f} MiB of anonymous memory "
                f"({100 * table / self.table_mib:.0f} % of the {self.table_mib:.0f} MiB bf16 table), mapping the layers "
                f"{layers:.0f} MiB more; weights mapped/dense (both with the embedding mapped): TTFT "
                f"{ratio('ttft_s', 'all mapped', 'embedding mapped'):.3f}, decode "
                f"{ratio('decode_tok_s', 'all mapped', 'embedding mapped'):.3f}; TTFT per run "
                + ", ".join(f"{mode} {runs[mode]}" for mode in MODES))


@dataclass
class MemoryReport:
    models: list[ModelMemory]
    n_runs: int
    prompt_tokens: int
    new_tokens: int

    def table(self) -> str:
        rows = []
        for m in self.models:
            for mode in MODES:
                first = m.runs[mode][0]
                anon, cache = m.median(mode, "anon_mib"), m.median(mode, "cache_mib")
                weights, tokenizer, state = (m.median(mode, k) for k in ("weights_mib", "tokenizer_mib", "state_mib"))
                rows.append([m.model, mode, f"{m.median(mode, 'load_s'):.1f}", f"{anon:.0f}", f"{cache:.0f}",
                             f"{anon - cache:.0f}", f"{weights:.0f}", f"{tokenizer:.0f}", f"{state:.0f}",
                             f"{anon - cache - weights - tokenizer - state:.0f}",
                             f"{m.median(mode, 'file_rss_mib'):.0f}", f"{m.median(mode, 'peak_rss_mib'):.0f}",
                             str(first["prompt_tokens"]), f"{m.median(mode, 'ttft_s'):.2f}",
                             f"{m.median(mode, 'decode_tok_s'):.1f}"])
        return markdown_table(["model", "mode", "load s", "anon after chat MiB", "prefix cache MiB",
                               "anon − cache MiB", "weights MiB", "tokenizer MiB", "state MiB", "runtime MiB",
                               "file RSS MiB", "peak RSS MiB", "prompt tokens", "TTFT s", "decode tok/s"],
                              rows, align="llrrrrrrrrrrrrr")

    def markdown(self) -> str:
        lines = "\n".join(f"- {m.saving_line()}" for m in self.models)
        return (f"One fresh `pagelm serve` per model, mode and run (prefix cache on, defaults otherwise), modes "
                f"interleaved; medians of {self.n_runs} run(s). Modes: all dense = `--embedding dense --weights "
                f"dense`, embedding mapped = `--embedding mapped --weights dense`, all mapped = the defaults. "
                f"A short chat (32 greedy tokens), then memory from "
                f"`/proc/PID` (anonymous = smaps_rollup `Anonymous`, file RSS = `RssFile`) and its parts from "
                f"`/api/ps`: the prefix cache's bytes, the weights' anonymous bytes (dense matrices, or the mapped "
                f"prefill scratch, and norms), the tokenizer's (anonymous memory added while building it), the "
                f"decode state's (the KV caches' pages written so far, DeltaNet states); runtime is the rest "
                f"(Python, torch, numba, buffers). Then a "
                f"{self.prompt_tokens}-token prompt with {self.new_tokens} greedy new tokens: TTFT is the "
                f"server's prefill time up to the first token (`prompt_eval_duration`), decode tok/s the "
                f"remaining tokens over `eval_duration`; peak RSS (`VmHWM`) is read after it.\n\n"
                f"{self.table()}\n\n{lines}\n")

    def chart(self, path: str) -> str:
        names = [m.model for m in self.models]
        panels = [Panel("anonymous memory after chat", "MiB", names,
                        {mode: [m.median(mode, "anon_mib") for m in self.models] for mode in MODES}),
                  Panel("peak RSS", "MiB", names,
                        {mode: [m.median(mode, "peak_rss_mib") for m in self.models] for mode in MODES})]
        return bar_chart(path, panels, "pagelm serve: embedding and layer weights, dense vs mapped")


def run_memory(models: list[tuple[str, str]], n_runs: int, prompt_tokens: int, new_tokens: int,
               mmproj: str | None = None) -> MemoryReport:
    """`models` are (name, path) pairs; `mmproj`, a vision tower for every server."""
    report = MemoryReport([], n_runs, prompt_tokens, new_tokens)
    for name, path in models:
        result = ModelMemory(display_name(name), embedding_table_mib(path))
        long_text = text_of_tokens(path, prompt_tokens)
        for run in range(1, n_runs + 1):
            for mode in MODES:  # interleaved, so drift in the machine's load hits both modes alike
                progress(f"memory {result.model}: run {run}/{n_runs}, {mode}")
                result.runs[mode].append(measure_once(path, mode, long_text, prompt_tokens, new_tokens,
                                                            mmproj))
        report.models.append(result)
        progress(result.saving_line())
    return report
