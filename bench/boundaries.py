"""Benchmark: the message boundaries of a long chat, old algorithm vs the marked render.

A 42-message conversation of about 5,000 tokens (a system prompt, then users and assistants in
turn, seeded pseudo-word text) on a model's own tokenizer and chat template. Times, median of
--runs calls of each in turn: rendering and encoding the prompt (what every request pays), the
old boundaries (each prefix of the conversation rendered and encoded again; the oracle in
tests/chat/test_boundaries.py) and the new ones (one marked render, tokens mapped at special tokens).

    .venv/bin/python bench/boundaries.py [--models qwen3.5-tiny-chat smollm2-135m] [--runs 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from head import median_ms

from pagelm.bench.inputs import display_name, model_path, text_of_tokens
from pagelm.chat.model import ChatModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_boundaries import old_boundaries  # noqa: E402 - the oracle lives with its test

MESSAGES, TOKENS, SYSTEM_TOKENS = 42, 5000, 400


def conversation(path: str) -> list[dict]:
    per_message = (TOKENS - SYSTEM_TOKENS) // (MESSAGES - 1) - 5  # ~5 template tokens per message
    messages = [{"role": "system", "content": text_of_tokens(path, SYSTEM_TOKENS, seed=0)}]
    for k in range(1, MESSAGES):
        role = "user" if k % 2 else "assistant"
        messages.append({"role": role, "content": text_of_tokens(path, per_message, seed=k)})
    return messages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3.5-tiny-chat", "smollm2-135m"])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    print("| model | messages | prompt tokens | render + encode ms | old boundaries ms | new boundaries ms | same |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in args.models:
        path = model_path(name)
        chat = ChatModel.open(path)
        messages = conversation(path)
        ends = chat.message_ends
        render_args = dict(add_generation_prompt=True, enable_thinking=False, tools=None)
        text = chat.template.render(messages, **render_args)
        tokens = chat.tokenizer.encode(text, add_special=True)

        def new():
            return ends.token_ends(ends.text_ends(messages, text, **render_args), text, tokens, chat.tokenizer)

        def prompt():
            return chat.tokenizer.encode(chat.template.render(messages, **render_args), add_special=True)

        same = chat.chat_prompt(messages, think=False).boundaries == old_boundaries(chat, messages, think=False)
        base, old, new_ms = median_ms([prompt, lambda: old_boundaries(chat, messages, think=False), new], args.runs)
        print(f"| {display_name(name)} | {len(messages)} | {len(tokens):,} | {base:.1f} | {old - base:.0f} | "
              f"{new_ms:.1f} | {'yes' if same else 'no (past answers end now)'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
