"""Benchmark: time to first token of a growing chat, prefix cache on vs off.

Two real `pagelm serve` processes on the same model (`--prefix-slots 32` and `--prefix-slots 0`),
the same 4-turn conversation sent to both, turn by turn alternately (the machine is noisy):
a long system document (~1,850 tokens) and short questions, greedy, thinking off, so by turn 4
the history is ~2,000 tokens. Prints per turn: prompt tokens, tokens reused from the cache, tokens
prefilled and how many of them the new message and the generation prompt are (the rest would be the
previous answer, computed again), TTFT with and without the cache, and whether the answers are
identical. Exit status 1 if the answers differ or a turn after the first prefills more than its new
message.

    python bench/prefix_cache.py [--model bench/models/qwen3.5-0.8b-q8_0.gguf] [--runs 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import ExitStack

from pagelm.bench.inputs import text_of_tokens
from pagelm.bench.server import ServerConfig, ServerProcess
from pagelm.chat.tokenizer import Tokenizer
from pagelm.formats.gguf import GGUFFile

QUESTIONS = ["Summarise the document in one sentence.", "Which word comes up most often?",
             "List three of its words.", "Which sentence is the longest?"]


def ask(server: ServerProcess, model: str, messages: list[dict]) -> tuple[str, float, dict]:
    """(answer, seconds to the first streamed token, usage) of one streamed chat request."""
    body = {"model": model, "messages": messages, "max_tokens": 32, "temperature": 0, "stream": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    start, ttft, parts, usage = time.perf_counter(), None, [], {}
    stream = server.stream("/v1/chat/completions", body)
    if stream.status != 200:
        raise SystemExit(f"HTTP {stream.status}: {list(stream.events)}")
    for chunk in stream.events:
        delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
        if delta.get("content") and ttft is None:
            ttft = time.perf_counter() - start
        parts.append(delta.get("content") or "")
        usage = chunk.get("usage") or usage
    return "".join(parts), ttft if ttft is not None else time.perf_counter() - start, usage


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench/models/qwen3.5-0.8b-q8_0.gguf")
    parser.add_argument("--runs", type=int, default=2, help="conversations per server (default 2)")
    parser.add_argument("--document-tokens", type=int, default=1850,
                        help="tokens of the system document (default 1850)")
    args = parser.parse_args()
    name = os.path.splitext(os.path.basename(args.model))[0]
    tokenizer = Tokenizer.from_gguf(GGUFFile.open(args.model))
    # what a turn must add to the cached history: its question (Qwen3.5's ChatML) and the generation prompt
    new_tokens = [len(tokenizer.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"))
                  for q in QUESTIONS]
    servers = {}
    with ExitStack() as stack:
        for label, cache in (("on", True), ("off", False)):
            print(f"starting cache-{label} server on {args.model}", file=sys.stderr)
            servers[label] = stack.enter_context(ServerProcess(args.model, ServerConfig(prefix_cache=cache, ctx_len=8192)))
        ttft = {(label, turn): [] for label in servers for turn in range(4)}
        rows, identical, only_new = {}, True, True
        for run in range(args.runs):
            # a different document per run, so that no run reuses the previous one's cache
            system = text_of_tokens(args.model, args.document_tokens, seed=run)
            history = {label: [{"role": "system", "content": system}] for label in servers}
            for turn, question in enumerate(QUESTIONS):
                answers = {}
                for label, server in servers.items():
                    history[label].append({"role": "user", "content": question})
                    answer, seconds, usage = ask(server, name, history[label])
                    history[label].append({"role": "assistant", "content": answer})
                    ttft[label, turn].append(seconds)
                    answers[label] = answer
                    if label == "on":
                        rows[turn] = (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
                        only_new &= turn == 0 or rows[turn][0] - rows[turn][1] == new_tokens[turn]
                if answers["on"] != answers["off"]:
                    identical = False
                    print(f"run {run + 1} turn {turn + 1} differs:\n  on:  {answers['on']!r}\n  off: {answers['off']!r}",
                          file=sys.stderr)
                print(f"run {run + 1} turn {turn + 1}: on {ttft['on', turn][-1]:.2f} s, "
                      f"off {ttft['off', turn][-1]:.2f} s", file=sys.stderr)
    print(f"model {name}, {args.runs} runs, medians; answers identical with the cache on and off: "
          f"{'yes' if identical else 'NO'}; turns 2-4 prefill only the new message: {'yes' if only_new else 'NO'}\n")
    print("| turn | prompt tokens | reused from cache | prefilled | of which new message + generation prompt "
          "| TTFT cache on (s) | TTFT cache off (s) | off / on |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for turn in range(4):
        on, off = statistics.median(ttft["on", turn]), statistics.median(ttft["off", turn])
        prompt, cached = rows[turn]
        print(f"| {turn + 1} | {prompt:,} | {cached:,} | {prompt - cached:,} | {new_tokens[turn]:,} | {on:.2f} | "
              f"{off:.2f} | {off / on:.1f}× |")
    return 0 if identical and only_new else 1


if __name__ == "__main__":
    sys.exit(main())
