"""A chat's next turn reuses the previous answer: after replying, the server keeps the answer as
the next request renders it (Qwen3.5's template drops the think block the generation prompt had),
so only the new message is prefilled; answers stay those of a server with the cache off."""

import httpx
import pytest


SYSTEM = "You are a terse assistant. Answer in a few words."
QUESTIONS = ["Name a colour.", "Name a fruit of that colour.", "Where does it grow?"]


def chat(server, messages, think):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300,
                   json={"model": server.model, "messages": messages, "max_tokens": 24, "temperature": 0,
                         "chat_template_kwargs": {"enable_thinking": think}})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"], r.json()["usage"]


@pytest.mark.parametrize("think", [False, True])
def test_the_next_turn_prefills_only_the_new_message(qwen, qwen_nocache, qwen35_chat, think):
    model = qwen35_chat
    generation_prompt = "<|im_start|>assistant\n<think>\n" + ("" if think else "\n</think>\n\n")
    histories = {"on": [{"role": "system", "content": SYSTEM}], "off": [{"role": "system", "content": SYSTEM}]}
    kept = None
    for turn, question in enumerate(QUESTIONS):
        answers = {}
        for label, server in (("on", qwen), ("off", qwen_nocache)):
            messages = histories[label]
            messages.append({"role": "user", "content": question})
            message, usage = chat(server, messages, think)
            answers[label] = message
            if label == "on":
                prompt = model.chat_prompt(messages, think)
                assert usage["prompt_tokens"] == len(prompt.tokens)
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                if kept is not None:
                    assert prompt.tokens[:len(kept)] == kept
                    assert cached == len(kept), f"turn {turn + 1}: {usage}"
                    new = model.tokenizer.decode(prompt.tokens[cached:])
                    assert new == f"<|im_start|>user\n{question}<|im_end|>\n{generation_prompt}"
                answered = prompt.answered(message.get("reasoning_content") or "", message["content"])
                kept = answered.tokens
            messages.append({k: v for k, v in message.items() if k in ("role", "content", "reasoning_content")})
        assert answers["on"] == answers["off"], f"turn {turn + 1}"
