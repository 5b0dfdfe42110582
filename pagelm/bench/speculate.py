"""`pagelm bench speculate`: plain against speculative decoding on built-in tasks made of texts that
ship with Python (its source and docstrings), in process: tokens per second, tokens kept per verify
pass, and whether any speculative answer differs from its plain one (it must not); with a `llama-server`
on PATH, llama.cpp's own speculation (n-gram, or the same draft model) on the same file and prompt tokens
beside it.

Owns the tasks and the measurement; the decoding is `Session.generate`'s, speculate off or on.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass, field

from pagelm.bench.report import markdown_table

TASKS = ("edit", "extract", "summarize", "chat")
# A run's own plain answer as its prediction: every draft right, so its ratio is what a verify pass and
# its rollback cost against one-token steps (the best speculation can do on this model)
ITS_ANSWER = object()


@dataclass(frozen=True)
class Task:
    name: str
    message: str  # the user's message
    prediction: str | None = None  # text the answer should mostly repeat, for the predicted-output run


def tasks() -> dict[str, Task]:
    """The built-in tasks: edit (a ~100-line function with one name changed; also with the original
    given as a prediction), extract (fields of a docstring as JSON), summarize (with quotes), chat."""
    code = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._wrap_chunks))
    document = argparse.__doc__.strip()
    return {
        "edit": Task("edit", "Rewrite this Python function with the variable `cur_line` renamed to `current_line`. "
                             f"Answer with the whole function and nothing else.\n\n```python\n{code}```", code),
        "extract": Task("extract", "From this documentation, give a JSON object with the fields \"module\", "
                                   "\"purpose\" and \"classes\" (the class names it mentions).\n\n" + document),
        "summarize": Task("summarize", "Summarize this documentation in three sentences, quoting it where you "
                                       "can.\n\n" + json.__doc__.strip()),
        "chat": Task("chat", "What is a Python generator, and when would you use one?"),
    }


@dataclass
class Row:
    task: str
    sampling: str
    plain_tok_s: list[float] = field(default_factory=list)
    spec_tok_s: list[float] = field(default_factory=list)
    per_pass: list[float] = field(default_factory=list)  # tokens made per verify pass (kept drafts + 1)
    differing: int = 0
    answers: int = 0

    @property
    def ratio(self) -> float:
        return statistics.median(self.spec_tok_s) / statistics.median(self.plain_tok_s)


@dataclass
class PeerRow:
    """llama-server's greedy decode tokens per second on one task, plain and speculating, and its answers."""

    task: str
    plain_tok_s: list[float] = field(default_factory=list)
    spec_tok_s: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)  # the share of its drafted tokens kept, where it reports it
    plain_answers: list[str] = field(default_factory=list)
    spec_answers: list[str] = field(default_factory=list)

    @property
    def differing(self) -> int:
        return sum(a != b for a, b in zip(self.plain_answers, self.spec_answers))


def llama_speculation(draft: str | None) -> tuple[str, ...]:
    """llama-server's flags for the speculation pagelm's run compares with: drafts from the context itself (its
    `ngram-simple`), as prompt lookup drafts, or from the `draft` model (`draft-simple`)."""
    return ("--spec-type", "ngram-simple") if draft is None else ("--spec-type", "draft-simple", "-md", draft)


@dataclass
class SpeculateReport:
    model: str
    tokens: int
    runs: int
    rows: list[Row]
    draft: str | None = None  # the draft model's name; None: prompt lookup (or the MTP layer)
    peer: list[PeerRow] = field(default_factory=list)  # llama-server's, where it ran
    mtp: bool = False  # drafts from the file's multi-token-prediction layer

    @property
    def differing(self) -> int:
        return sum(r.differing for r in self.rows)

    def markdown(self) -> str:
        table = markdown_table(
            ["task", "sampling", "plain tok/s", "speculative tok/s", "tokens per pass", "× plain"],
            [[r.task, r.sampling, f"{statistics.median(r.plain_tok_s):.1f}", f"{statistics.median(r.spec_tok_s):.1f}",
              f"{statistics.median(r.per_pass):.2f}", f"{r.ratio:.2f}"] for r in self.rows], "llrrrr")
        source = "the file's MTP layer" if self.mtp else "prompt lookup" if self.draft is None else \
            f"drafts from {self.draft}"
        lines = [f"### Speculative decoding: {self.model}, {source} ({self.tokens} tokens, medians of {self.runs} runs)",
                 "",
                 table, ""]
        lines += [f"{r.task}{'' if r.sampling == 'greedy' else ' ' + r.sampling}: {r.ratio:.2f}× plain"
                  for r in self.rows]
        lines += self._peer_lines()
        lines.append(f"differing answers: {self.differing} of {sum(r.answers for r in self.rows)}")
        return "\n".join(lines)

    def _peer_lines(self) -> list[str]:
        if self.mtp:
            return ["llama-server: not compared (MTP drafts)"]
        if not self.peer:
            return ["llama-server: not on PATH, not compared"]
        ours = {r.task: r for r in self.rows if r.sampling == "greedy"}
        table = markdown_table(
            ["task", "llama.cpp plain tok/s", "llama.cpp speculative tok/s", "drafts kept",
             "pagelm speculative / llama.cpp's"],
            [[p.task, f"{statistics.median(p.plain_tok_s):.1f}", f"{statistics.median(p.spec_tok_s):.1f}",
              f"{statistics.median(p.accepted):.0%}" if p.accepted else "-",
              f"{statistics.median(ours[p.task].spec_tok_s) / statistics.median(p.spec_tok_s):.2f}"]
             for p in self.peer], "lrrrr")
        flags = " ".join(os.path.basename(f) for f in llama_speculation(self.draft))
        return ["", f"llama-server on the same file and prompt tokens, greedy, speculating with `{flags}`:", "", table,
                "", f"llama-server's speculative answers differing from its plain ones: "
                    f"{sum(p.differing for p in self.peer)} of {sum(len(p.spec_answers) for p in self.peer)}", ""]


def _llama_server_rows(path: str, prompts: dict[str, list[int]], tokens: int, runs: int, threads: int,
                       draft: str | None) -> list[PeerRow]:
    """llama-server's greedy answers and decode tokens per second (its own timings) on each task's prompt tokens,
    plain and speculating (llama_speculation), each server in turn, --runs times, prompt caching off."""
    from pagelm.bench.concurrency import LlamaServer

    rows = {task: PeerRow(task) for task in prompts}
    ctx_len = max(len(ids) for ids in prompts.values()) + tokens + 16
    for flags in ((), llama_speculation(draft)):
        with LlamaServer(path, 1, ctx_len, threads, flags) as server:
            for task, ids in prompts.items():
                for run in range(runs):
                    print(f"llama-server{' ' + flags[1] if flags else ''} {task}: run {run + 1} of {runs}",
                          file=sys.stderr, flush=True)
                    reply = server.post("/completion", {"prompt": ids, "n_predict": tokens, "temperature": 0,
                                                        "top_k": 1, "cache_prompt": False})
                    if reply.status != 200:
                        raise RuntimeError(f"llama-server answered {reply.status}: {reply.body}")
                    row, timings = rows[task], reply.body["timings"]
                    (row.spec_tok_s if flags else row.plain_tok_s).append(timings["predicted_per_second"])
                    (row.spec_answers if flags else row.plain_answers).append(reply.body["content"])
                    if flags and timings.get("draft_n"):
                        row.accepted.append(timings["draft_n_accepted"] / timings["draft_n"])
    return list(rows.values())


def _timed(session, checkpoint, params, speculate) -> tuple[list[int], float]:
    """The answer from a restored prompt, and its decode tokens per second (after its first token)."""
    session.restore(checkpoint)
    tokens, start = [], 0.0
    for token in session.generate([], params, speculate=speculate):
        if not tokens:
            start = time.perf_counter()
        tokens.append(token)
    seconds = time.perf_counter() - start
    return tokens, (len(tokens) - 1) / seconds if seconds > 0 and len(tokens) > 1 else 0.0


def run_speculate(name: str, path: str, names: list[str], tokens: int, runs: int,
                  draft: str | None = None, mtp: bool = False) -> SpeculateReport:
    """Each task × greedy and seeded (temperature 0.7) sampling, plus edit with its original code as
    a prediction, plus each task's plain greedy answer given as its own prediction (ITS_ANSWER): plain
    and speculative decoding in turn, --runs times; every speculative answer compared with its plain one.
    `draft`: a draft model's path, whose drafts (from a fresh session each run: its prefill of the prompt
    is in the time) replace prompt lookup; `mtp`: the file's MTP layer's drafts instead (made before the
    prompt's prefill, so that the layer reads the prompt's hidden states, once: its reading is not timed)."""
    from pagelm.chat.model import ChatModel
    from pagelm.engine.sampling import SamplingParams
    from pagelm.engine.speculate import DraftModel, MtpDraft, Prediction, Speculator, check_mode
    from pagelm.runtime.threads import kernel_threads

    chat = ChatModel.open(path, name=name)
    if mtp:
        check_mode("mtp", chat.model)
    draft_model = None if draft is None else chat.open_draft(draft)
    samplings = {"greedy": SamplingParams(max_tokens=tokens),
                 "seeded": SamplingParams(temperature=0.7, seed=1, max_tokens=tokens)}
    rows, prompts = [], {}
    for task in (tasks()[n] for n in names):
        prompt = prompts[task.name] = chat.chat_prompt([{"role": "user", "content": task.message}], think=False).tokens
        session = chat.model.session(len(prompt) + tokens + 1)
        drafter = MtpDraft.of(session) if mtp else None
        session.prefill(prompt)
        checkpoint = session.checkpoint()
        variants = [(s, None) for s in samplings] + ([("greedy", task.prediction)] if task.prediction else []) \
            + [("greedy", ITS_ANSWER)]
        for sampling, prediction in variants:
            row = Row(task.name if prediction is None else
                      f"{task.name} + {'its answer' if prediction is ITS_ANSWER else 'prediction'}", sampling)
            predicted = None if prediction in (None, ITS_ANSWER) else chat.tokenizer.encode(prediction)
            for run in range(runs):
                print(f"{row.task} {sampling}: run {run + 1} of {runs}", file=sys.stderr, flush=True)
                plain, plain_tok_s = _timed(session, checkpoint, samplings[sampling], "off")
                if prediction is ITS_ANSWER:
                    predicted = plain
                if predicted is not None:
                    speculator = Speculator(Prediction(predicted))
                elif draft_model is not None:
                    speculator = Speculator(DraftModel.of(draft_model, chat.model.head.vocab_size, session.max_len))
                elif drafter is not None:
                    speculator = Speculator.of("mtp", session=session)
                else:
                    speculator = Speculator()
                spec, spec_tok_s = _timed(session, checkpoint, samplings[sampling], speculator)
                s = speculator.stats
                row.plain_tok_s.append(plain_tok_s)
                row.spec_tok_s.append(spec_tok_s)
                row.per_pass.append((s.accepted + s.passes) / s.passes if s.passes else 1.0)
                row.differing += spec != plain
                row.answers += 1
            rows.append(row)
    peer = _llama_server_rows(path, prompts, tokens, runs, kernel_threads(), draft) \
        if shutil.which("llama-server") and not mtp else []
    return SpeculateReport(name, tokens, runs, rows, None if draft is None else os.path.basename(draft), peer, mtp)
