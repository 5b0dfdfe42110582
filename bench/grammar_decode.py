"""What constrained decoding adds to a decode step: one process, one model, N tokens decoded
unconstrained and constrained, alternating, --runs times: by bench/grammar_mask.py's JSON schema,
or (`--grammar tool-call`) by the grammar of a forced call to a weather tool in Qwen3.5's XML form.
Per-token time is the decode loop's (first token to last) over the tokens after the first; the
mask time is pagelm.chat.grammar.Matcher's mask + accept alone.

    .venv/bin/python bench/grammar_decode.py [MODEL.gguf] [--tokens 64] [--runs 5] [--grammar json|tool-call]

MODEL defaults to bench/models/qwen3.5-0.8b-q8_0.gguf (`pagelm synth --shape qwen3.5-0.8b
--layer-type Q8_0 bench/models/qwen3.5-0.8b-q8_0.gguf` writes it). Random weights write an endless
string in the schema's first (unbounded) string field (or the call's raw `city` value, up to 512
characters), so both sides decode the full N tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

from grammar_mask import SCHEMA

from pagelm.chat.model import ChatModel
from pagelm.chat.tools import QwenXmlFormat, Tool
from pagelm.chat.grammar import Grammar, Matcher
from pagelm.engine.sampling import SamplingParams


WEATHER = Tool("get_weather", "Weather forecast for a city", {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14}}})


class TimedMatcher:
    """A Matcher that adds up the seconds spent in mask and accept."""

    def __init__(self, matcher: Matcher):
        self.matcher, self.seconds = matcher, 0.0

    def mask(self, logits):
        start = time.perf_counter()
        out = self.matcher.mask(logits)
        self.seconds += time.perf_counter() - start
        return out

    def accept(self, token: int) -> None:
        start = time.perf_counter()
        self.matcher.accept(token)
        self.seconds += time.perf_counter() - start


def decode(chat: ChatModel, prompt: list[int], params: SamplingParams, constraint) -> tuple[int, float]:
    """(tokens generated, seconds from the first token to the last)."""
    session = chat.model.session(len(prompt) + params.max_tokens + 1)
    count, first = 0, 0.0
    for _ in session.generate(prompt, params, constraint=constraint):
        count += 1
        if count == 1:
            first = time.perf_counter()
    return count, time.perf_counter() - first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="bench/models/qwen3.5-0.8b-q8_0.gguf")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--grammar", choices=["json", "tool-call"], default="json")
    args = parser.parse_args()
    chat = ChatModel.open(args.model)
    start = time.perf_counter()
    if args.grammar == "json":
        what = "JSON schema"
        grammar = Grammar.json_schema(chat.tokenizer, SCHEMA)
        prompt = chat.chat_prompt([{"role": "user", "content": "Describe Ada Lovelace as JSON."}], think=False).tokens
    else:
        what = "forced tool call"
        grammar = Grammar.lark(chat.tokenizer, QwenXmlFormat().grammar([WEATHER], parallel=False))
        prompt = chat.chat_prompt([{"role": "user", "content": "Weather in Paris?"}], think=False,
                                  tools=[WEATHER.for_template()]).tokens
    print(f"{chat.name}: llguidance tokenizer + {what} compile {time.perf_counter() - start:.2f} s")
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=args.tokens)
    decode(chat, prompt, params, None)  # warm-up: kernels, page cache
    free_ms, constrained_ms, mask_ms = [], [], []
    for run in range(args.runs):
        for constrained in ((False, True) if run % 2 == 0 else (True, False)):
            timed = TimedMatcher(grammar.matcher()) if constrained else None
            count, seconds = decode(chat, prompt, params, timed)
            if count < 2:
                raise SystemExit(f"only {count} token(s) decoded: nothing to time")
            (constrained_ms if constrained else free_ms).append(seconds / (count - 1) * 1e3)
            if constrained:
                mask_ms.append(timed.seconds / count * 1e3)
            print(f"run {run + 1} {'constrained' if constrained else 'free':<11} {count} tokens "
                  f"{seconds / (count - 1) * 1e3:7.2f} ms/token", flush=True)
    free, constrained = statistics.median(free_ms), statistics.median(constrained_ms)
    print(f"\n| decode, {args.tokens} tokens, median of {args.runs} | ms / token |")
    print("|---|---:|")
    print(f"| unconstrained | {free:.2f} |")
    print(f"| constrained ({what}) | {constrained:.2f} |")
    print(f"| of which mask + accept | {statistics.median(mask_ms):.3f} |")
    print(f"| constrained / unconstrained | {constrained / free:.3f} |")


if __name__ == "__main__":
    main()
