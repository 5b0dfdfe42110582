"""`pagelm bench scenarios`: the same fixed, seeded requests against every way of serving a
model (embedding dense / mapped × prefix cache on / off); what a user sees must not differ.

Owns the scenarios and the comparison. Content, reasoning, token counts and finish reasons are
compared across every configuration; prefix-cache counters (lookups, hits, cached tokens) only
among configurations with the same cache setting, since turning the cache off changes them.
"""

from __future__ import annotations

import base64
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pagelm.bench.inputs import display_name, text_of_tokens
from pagelm.bench.report import markdown_table
from pagelm.bench.server import ServerConfig, ServerProcess, mmproj_flags, progress



def configs(weights: str = "mapped") -> tuple[ServerConfig, ...]:
    """Embedding dense / mapped × prefix cache on / off, all with the same weights mode (dense and
    mapped weights decode with different roundings, so they are not compared with each other)."""
    return tuple(ServerConfig(embedding, cache, weights=weights) for cache in (True, False)
                 for embedding in ("dense", "mapped"))

LONG_PROMPT_TOKENS = 2600
MAX_TOKENS = 32
# a 1×1 PNG of one red pixel: a vision model reads it as 64 image tokens (the smallest image)
PNG_1X1 = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de"
    "0000000c4944415478da633821a7010002c0010fe4bd52150000000049454e44ae426082")).decode()
SYSTEM = "You are a careful assistant for a weather station. Answer briefly and plainly."
TURNS = ("What does a barometer measure?", "And what does falling pressure usually mean?",
         "How fast can it fall before a storm?", "Summarise all of that in one sentence.")


@dataclass
class Observation:
    """What one scenario showed on one server. `output` must match across all configurations,
    `cache` among those with the same cache setting; `info` is shown, never compared."""

    output: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    skipped: str | None = None


class Client:
    """The requests scenarios make, each returning the fields worth comparing."""

    def __init__(self, server: ServerProcess, model: str):
        self.server, self.model = server, model

    def chat(self, messages: list[dict], think: bool | None = None, max_tokens: int = MAX_TOKENS,
             **extra) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
        if think is not None:
            body["chat_template_kwargs"] = {"enable_thinking": think}
        reply = self.server.post("/v1/chat/completions", body)
        if reply.status != 200:
            return {"status": reply.status, "error": reply.body.get("error", {}).get("message")}
        choice, usage = reply.body["choices"][0], reply.body["usage"]
        return {"content": choice["message"]["content"],
                "reasoning": choice["message"].get("reasoning_content", ""),
                "finish_reason": choice["finish_reason"], "prompt_tokens": usage["prompt_tokens"],
                "completion_tokens": usage["completion_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}

    def cache_counters(self) -> dict:
        cache = self.server.stats()["prefix_cache"]
        return {key: cache[key] for key in ("lookups", "hits", "tokens_reused")}


def _split(result: dict) -> tuple[dict, dict]:
    """(fields every configuration must agree on, cache-dependent fields)."""
    cached = {"cached_tokens": result["cached_tokens"]} if "cached_tokens" in result else {}
    return {k: v for k, v in result.items() if k != "cached_tokens"}, cached


def _single(client: Client, messages: list[dict], **kwargs) -> Observation:
    output, cache = _split(client.chat(messages, **kwargs))
    return Observation(output, cache)


def think_on(client: Client, ctx: dict) -> Observation:
    return _single(client, [{"role": "user", "content": "Why is the sky blue? Two sentences."}], think=True,
                   max_tokens=48)


def think_off(client: Client, ctx: dict) -> Observation:
    return _single(client, [{"role": "user", "content": "Why is the sky blue? Two sentences."}], think=False)


def long_prompt(client: Client, ctx: dict) -> Observation:
    text = "Read these notes, then name the word that appears most often.\n\n" + ctx["long_text"]
    return _single(client, [{"role": "user", "content": text}], think=False, max_tokens=16)


def conversation(client: Client, ctx: dict) -> Observation:
    """Four turns of one chat: each request resends the history, so the prefix cache grows."""
    messages = [{"role": "system", "content": SYSTEM}]
    turns, cached = [], []
    for question in TURNS:
        messages.append({"role": "user", "content": question})
        output, cache = _split(client.chat(messages, think=False, max_tokens=24))
        turns.append(output)
        cached.append(cache.get("cached_tokens"))
        messages.append({"role": "assistant", "content": output.get("content", "")})
    return Observation({"turns": turns}, {"cached_tokens": cached})


def shared_system_prompt(client: Client, ctx: dict) -> Observation:
    """A new chat with the conversation's system prompt: the cache can reuse the system turn."""
    return _single(client, [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "Is a sealed jar a barometer?"}], think=False)


def _image_request(client: Client) -> Observation:
    message = {"role": "user", "content": [
        {"type": "text", "text": "What colour is this pixel?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_1X1}"}}]}
    result = client.chat([message], think=False)
    if result.get("status") == 400 and "vision" in (result.get("error") or ""):
        return Observation(skipped=f"no vision yet (HTTP 400: {result['error']})")
    output, cache = _split(result)
    return Observation(output, cache)


def image(client: Client, ctx: dict) -> Observation:
    return _image_request(client)


def image_again(client: Client, ctx: dict) -> Observation:
    return _image_request(client)


def cancel_then_normal(client: Client, ctx: dict) -> Observation:
    """A stream cancelled by id after its 4th delta, then an ordinary request: the cancel must
    leave the server serving the next request exactly as before. How many tokens the cancelled
    request got out before the cancel landed depends on timing: shown, not compared."""
    request_id = "bench-cancel-1"
    body = {"model": client.model, "messages": [{"role": "user", "content": "Count slowly from one to a thousand."}],
            "max_tokens": 1000, "temperature": 0, "stream": True, "chat_template_kwargs": {"enable_thinking": False}}
    stream = client.server.stream("/v1/chat/completions", body, {"X-Request-Id": request_id})
    first, cancel_status, finish, usage = [], None, None, {}
    for event in stream.events:
        choice = event["choices"][0] if event.get("choices") else {}
        delta = choice.get("delta", {})
        if "content" in delta or "reasoning_content" in delta:
            if len(first) < 4:
                first.append(delta.get("content", "") + delta.get("reasoning_content", ""))
            if len(first) == 4 and cancel_status is None:
                cancel_status = client.server.post("/api/cancel", {"id": request_id}).status
        finish = choice.get("finish_reason") or finish
        usage = event.get("usage") or usage
    stream.close()
    after = client.chat([{"role": "user", "content": "Name three primary colours."}], think=False)
    output, cache = _split(after)
    return Observation({"header_id": stream.headers.get("x-request-id") == request_id, "first_deltas": first,
                        "cancel_status": cancel_status, "finish_reason": finish, "next": output},
                       {"next": cache}, info={"cancelled_after_tokens": usage.get("completion_tokens")})


def ollama_chat(client: Client, ctx: dict) -> Observation:
    """The Ollama route, NDJSON streamed, thinking off."""
    body = {"model": client.model, "messages": [{"role": "user", "content": "Give me a haiku about rain."}],
            "think": False, "options": {"temperature": 0, "num_predict": MAX_TOKENS}}
    stream = client.server.stream("/api/chat", body)
    content, thinking, done = [], [], {}
    for event in stream.events:
        content.append(event.get("message", {}).get("content", ""))
        thinking.append(event.get("message", {}).get("thinking", ""))
        if event.get("done"):
            done = event
    return Observation({"status": stream.status, "content": "".join(content), "reasoning": "".join(thinking),
                        "done_reason": done.get("done_reason"), "eval_count": done.get("eval_count"),
                        "prompt_tokens": done.get("prompt_eval_count", 0) + done.get("prompt_cached_count", 0)},
                       {"prompt_cached_count": done.get("prompt_cached_count")})


def seeded_sampling(client: Client, ctx: dict) -> Observation:
    """Temperature sampling with a seed: the same seed must draw the same tokens in every mode."""
    return _single(client, [{"role": "user", "content": "Invent a name for a small red boat."}], think=False,
                   temperature=0.9, top_p=0.95, top_k=40, seed=1234)


def raw_completion(client: Client, ctx: dict) -> Observation:
    """/v1/completions: plain text, no chat template, no reasoning split."""
    reply = client.server.post("/v1/completions", {"model": client.model, "prompt": "The three laws of motion are",
                                                   "max_tokens": MAX_TOKENS, "temperature": 0})
    if reply.status != 200:
        return Observation({"status": reply.status, "error": reply.body.get("error", {}).get("message")})
    choice, usage = reply.body["choices"][0], reply.body["usage"]
    return Observation({"text": choice["text"], "finish_reason": choice["finish_reason"],
                        "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"]},
                       {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]})


SCENARIOS: dict[str, Callable[[Client, dict], Observation]] = {
    "think-on": think_on,
    "think-off": think_off,
    "long-prompt": long_prompt,
    "conversation-4-turns": conversation,
    "shared-system-prompt": shared_system_prompt,
    "image": image,
    "image-again": image_again,
    "cancel-then-normal": cancel_then_normal,
    "ollama-chat-stream": ollama_chat,
    "seeded-sampling": seeded_sampling,
    "raw-completion": raw_completion,
}


@dataclass
class Run:
    """One scenario on one server: configuration, run number, what it showed, and the
    prefix-cache counters it moved (lookups, hits, tokens reused)."""

    config: ServerConfig
    run: int
    observation: Observation
    counters: dict


def differences(runs: list[Run]) -> list[str]:
    """Why the runs of one scenario disagree (empty when they agree)."""
    if not runs:
        return []
    reasons = []
    skipped = {r.observation.skipped is not None for r in runs}
    if len(skipped) > 1:
        return ["skipped on some configurations only"]
    if skipped == {True}:
        return []
    reference = runs[0]
    for r in runs[1:]:
        if r.observation.output != reference.observation.output:
            keys = _differing_keys(r.observation.output, reference.observation.output)
            reasons.append(f"{r.config.label} run {r.run}: {', '.join(keys)} differ from "
                           f"{reference.config.label} run {reference.run}")
    for cache_on in (True, False):
        group = [r for r in runs if r.config.prefix_cache == cache_on]
        for r in group[1:]:
            for what, mine, theirs in (("cache counters", r.counters, group[0].counters),
                                       ("cached tokens", r.observation.cache, group[0].observation.cache)):
                if mine != theirs:
                    reasons.append(f"{r.config.label} run {r.run}: {what} {mine} differ from "
                                   f"{group[0].config.label} run {group[0].run} {theirs}")
    return reasons


def _differing_keys(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _token_counts(observation: Observation) -> tuple[str, str]:
    out = observation.output
    if "turns" in out:
        out = {"prompt_tokens": "/".join(str(t.get("prompt_tokens")) for t in out["turns"]),
               "completion_tokens": "/".join(str(t.get("completion_tokens")) for t in out["turns"])}
    elif "next" in out:
        out = {"prompt_tokens": out["next"].get("prompt_tokens"),
               "completion_tokens": f"{observation.info.get('cancelled_after_tokens')}, then "
                                    f"{out['next'].get('completion_tokens')}"}
    elif "eval_count" in out:
        out = {"prompt_tokens": out.get("prompt_tokens"), "completion_tokens": out["eval_count"]}
    return str(out.get("prompt_tokens", "-")), str(out.get("completion_tokens", "-"))


def _errors(value) -> list[str]:
    """Error messages anywhere in an observation's output: a scenario that fails the same way
    everywhere is 'same', but the table must say it failed."""
    if isinstance(value, dict):
        found = [f"HTTP {value.get('status')}: {value['error']}"] if "error" in value else []
        return found + [e for v in value.values() for e in _errors(v)]
    if isinstance(value, list):
        return [e for v in value for e in _errors(v)]
    return []


def _counters_cell(runs: list[Run], cache_on: bool) -> str:
    values = {(r.counters["lookups"], r.counters["hits"]) for r in runs if r.config.prefix_cache == cache_on}
    return " or ".join(f"{lookups}/{hits}" for lookups, hits in sorted(values)) or "-"


def scenario_table(results: dict[str, list[Run]]) -> str:
    rows = []
    for name, runs in results.items():
        first = runs[0].observation
        if first.skipped is not None:
            rows.append([name, "skipped", "-", "-", "-", "-", first.skipped])
            continue
        prompt, completion = _token_counts(first)
        reasons = differences(runs)
        rows.append([name, "DIFFERS" if reasons else "same", prompt, completion, _counters_cell(runs, True),
                     _counters_cell(runs, False), "; ".join(_errors(first.output) + reasons)])
    return markdown_table(["scenario", "result", "prompt tokens", "completion tokens",
                           "cache on: lookups/hits", "cache off: lookups/hits", "notes"],
                          rows, align="llrrrrl")


def summary_line(results: dict[str, list[Run]], n_runs: int) -> str:
    differing = sum(bool(differences(runs)) for runs in results.values())
    skipped = sum(runs[0].observation.skipped is not None for runs in results.values() if runs)
    return (f"differing scenarios: {differing} of {len(results)} in {n_runs} runs"
            + (f" ({skipped} skipped)" if skipped else ""))


@dataclass
class ScenarioReport:
    model: str
    n_runs: int
    configs: tuple[ServerConfig, ...]
    results: dict[str, list[Run]]

    @property
    def differing(self) -> int:
        return sum(bool(differences(runs)) for runs in self.results.values())

    def markdown(self) -> str:
        labels = "; ".join(c.label for c in self.configs)
        return (f"Model `{self.model}`, weights {self.configs[0].weights}; configurations: {labels}; one fresh `pagelm serve` per configuration "
                f"and run, configurations interleaved. Content, reasoning, token counts and finish reasons are "
                f"compared across all configurations; prefix-cache lookups/hits and cached tokens only among "
                f"configurations with the same cache setting (turning the cache off changes them by design).\n\n"
                f"{scenario_table(self.results)}\n\n{summary_line(self.results, self.n_runs)}\n")


def run_scenarios(model_name: str, model_path: str, n_runs: int, weights: str = "mapped",
                  names: tuple[str, ...] = tuple(SCENARIOS), mmproj: str | None = None) -> ScenarioReport:
    """Every scenario (of `names`) on every configuration, `n_runs` times, configurations interleaved;
    `mmproj`: the model's vision tower, when not beside it."""
    chosen = configs(weights)
    model = display_name(model_name)
    context = {"long_text": text_of_tokens(model_path, LONG_PROMPT_TOKENS)} if "long-prompt" in names else {}
    results: dict[str, list[Run]] = {name: [] for name in names}
    for run, config in itertools.product(range(1, n_runs + 1), chosen):
        progress(f"scenarios {model}: run {run}/{n_runs}, {config.label}")
        with ServerProcess(model_path, config, mmproj_flags(mmproj)) as server:
            client = Client(server, Path(model_path).stem)  # the name `pagelm serve` gives a file
            for name in names:
                before = client.cache_counters()
                observation = SCENARIOS[name](client, context)
                after = client.cache_counters()
                counters = {k: after[k] - before[k] for k in after}
                results[name].append(Run(config, run, observation, counters))
    progress(f"scenarios {model}: {summary_line(results, n_runs)}")
    return ScenarioReport(model, n_runs, chosen, results)
