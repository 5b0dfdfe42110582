"""`pagelm bench speculate`: plain against speculative decoding on built-in tasks made of texts that
ship with Python (its source and docstrings), in process: tokens per second, tokens kept per verify
pass, and whether any speculative answer differs from its plain one (it must not).

Owns the tasks and the measurement; the decoding is `Session.generate`'s, speculate off or on.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass, field

from pagelm.bench.report import markdown_table

TASKS = ("edit", "extract", "summarize", "chat")


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
class SpeculateReport:
    model: str
    tokens: int
    runs: int
    rows: list[Row]
    draft: str | None = None  # the draft model's name; None: prompt lookup

    @property
    def differing(self) -> int:
        return sum(r.differing for r in self.rows)

    def markdown(self) -> str:
        table = markdown_table(
            ["task", "sampling", "plain tok/s", "speculative tok/s", "tokens per pass", "× plain"],
            [[r.task, r.sampling, f"{statistics.median(r.plain_tok_s):.1f}", f"{statistics.median(r.spec_tok_s):.1f}",
              f"{statistics.median(r.per_pass):.2f}", f"{r.ratio:.2f}"] for r in self.rows], "llrrrr")
        source = "prompt lookup" if self.draft is None else f"drafts from {self.draft}"
        lines = [f"### Speculative decoding: {self.model}, {source} ({self.tokens} tokens, medians of {self.runs} runs)",
                 "",
                 table, ""]
        lines += [f"{r.task}{'' if r.sampling == 'greedy' else ' ' + r.sampling}: {r.ratio:.2f}× plain"
                  for r in self.rows]
        lines.append(f"differing answers: {self.differing} of {sum(r.answers for r in self.rows)}")
        return "\n".join(lines)


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
                  draft: str | None = None) -> SpeculateReport:
    """Each task × greedy and seeded (temperature 0.7) sampling, plus edit with its original code as
    a prediction: plain and speculative decoding in turn, --runs times; every speculative answer
    compared with its plain one. `draft`: a draft model's path, whose drafts (from a fresh session
    each run: its prefill of the prompt is in the time) replace prompt lookup."""
    from pagelm.chat.model import ChatModel
    from pagelm.engine.sampling import SamplingParams
    from pagelm.engine.speculate import DraftModel, Prediction, PromptLookup, Speculator

    chat = ChatModel.open(path, name=name)
    draft_model = None if draft is None else chat.open_draft(draft)
    samplings = {"greedy": SamplingParams(max_tokens=tokens),
                 "seeded": SamplingParams(temperature=0.7, seed=1, max_tokens=tokens)}
    rows = []
    for task in (tasks()[n] for n in names):
        prompt = chat.chat_prompt([{"role": "user", "content": task.message}], think=False).tokens
        session = chat.model.session(len(prompt) + tokens + 1)
        session.prefill(prompt)
        checkpoint = session.checkpoint()
        variants = [(s, None) for s in samplings] + ([("greedy", task.prediction)] if task.prediction else [])
        for sampling, prediction in variants:
            row = Row(task.name if prediction is None else f"{task.name} + prediction", sampling)
            predicted = None if prediction is None else chat.tokenizer.encode(prediction)
            for run in range(runs):
                print(f"{row.task} {sampling}: run {run + 1} of {runs}", file=sys.stderr, flush=True)
                plain, plain_tok_s = _timed(session, checkpoint, samplings[sampling], "off")
                if predicted is not None:
                    speculator = Speculator(Prediction(predicted, then=PromptLookup()))
                elif draft_model is not None:
                    speculator = Speculator(DraftModel.of(draft_model, chat.model.head.vocab_size, session.max_len))
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
    return SpeculateReport(name, tokens, runs, rows, None if draft is None else os.path.basename(draft))
