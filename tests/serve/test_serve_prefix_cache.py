"""The prefix cache seen from outside: multi-turn chats reuse earlier turns, answers are the same
as with the cache off, and conversations sharing a system prompt reuse it."""

import httpx
import pytest

from pagelm.chat.model import ChatModel

SYSTEM = ("You are the reference desk assistant of a large public library. You answer questions about "
          "geography, history, science and literature briefly and accurately, in one or two sentences. "
          "When you are not sure, you say so plainly instead of guessing. You never invent book titles, "
          "authors, dates or numbers. You prefer well-known facts from encyclopedias. You write in plain "
          "English without lists, tables or markdown, and you do not repeat the question back to the reader.")
QUESTIONS = ["What is the capital of France?", "What river flows through it?",
             "Name a famous museum in that city.", "Who painted the Mona Lisa?"]
# a question no other test asks, per setup, so nothing but the system prompt can be cached
OTHER = {"smollm2": "What is the largest planet in the solar system?",
         "qwen35-no-thinking": "How many legs does a spider have?",
         "qwen35-thinking": "What is the boiling point of water at sea level?"}

# model → (cache-on server fixture, cache-off server fixture, extra request fields, model file fixture)
SETUPS = {
    "smollm2": ("smol", "smol_nocache", {}, "smollm2_gguf"),
    "qwen35-no-thinking": ("qwen", "qwen_nocache", {"chat_template_kwargs": {"enable_thinking": False}},
                           "qwen35_chat_gguf"),
    "qwen35-thinking": ("qwen", "qwen_nocache", {"chat_template_kwargs": {"enable_thinking": True}},
                        "qwen35_chat_gguf"),
}


def converse(server, questions, extra, system=SYSTEM, max_tokens=16):
    """Greedy chat, one question a turn, each answer appended; per turn: (answer, usage, cache hits)."""
    messages = [{"role": "system", "content": system}]
    turns = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300,
                       json={"model": server.model, "messages": messages, "max_tokens": max_tokens,
                             "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if k in ("role", "content", "reasoning_content")})
        answer = (message.get("reasoning_content"), message["content"])
        turns.append((answer, r.json()["usage"], server.ps()["prefix_cache"]["hits"]))
    return turns


@pytest.fixture(params=list(SETUPS))
def setup(request):
    on, off, extra, path = SETUPS[request.param]
    return (request.getfixturevalue(on), request.getfixturevalue(off), extra, request.getfixturevalue(path),
            request.param)


def test_later_turns_reuse_cached_tokens_and_hits_increase(setup):
    server, _, extra, _, _ = setup
    hits_before = server.ps()["prefix_cache"]["hits"]
    turns = converse(server, QUESTIONS, extra)
    hits = [hits_before] + [hits for _, _, hits in turns]
    print([(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]) for _, u, _ in turns])
    for k in range(1, len(turns)):
        usage, previous = turns[k][1], turns[k - 1][1]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0, f"turn {k + 1}: {usage}"
        # at least everything up to the previous question was computed before
        assert cached >= previous["prompt_tokens"] - 8, f"turn {k + 1}: {usage} after {previous}"
        assert cached < usage["prompt_tokens"]
        assert hits[k + 1] > hits[k]


def test_answers_are_the_same_with_the_cache_off(setup):
    on, off, extra, _, _ = setup
    cached_turns = converse(on, QUESTIONS, extra)
    plain_turns = converse(off, QUESTIONS, extra)
    assert [a for a, _, _ in cached_turns] == [a for a, _, _ in plain_turns]
    assert [u["prompt_tokens"] for _, u, _ in cached_turns] == [u["prompt_tokens"] for _, u, _ in plain_turns]
    assert all(u["prompt_tokens_details"]["cached_tokens"] == 0 for _, u, _ in plain_turns)
    stats = off.ps()["prefix_cache"]
    assert stats["enabled"] is False and stats["hits"] == 0 and stats["entries"] == 0


def system_prompt_tokens(path, extra, question) -> tuple[int, int]:
    """(tokens up to the end of the system message, i.e. through its first <|im_end|>; whole prompt
    tokens) of [SYSTEM, question] as the server renders it (both models use ChatML)."""
    chat = ChatModel.open(path)
    think = (extra.get("chat_template_kwargs") or {}).get("enable_thinking")
    prompt = chat.chat_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], think)
    texts = [chat.tokenizer.decode([t], skip_special=False) for t in prompt.tokens]
    return texts.index("<|im_end|>") + 1, len(prompt.tokens)


def test_a_new_conversation_reuses_the_shared_system_prompt(setup):
    server, _, extra, path, name = setup
    converse(server, QUESTIONS[:1], extra)
    system_tokens, prompt_tokens = system_prompt_tokens(path, extra, OTHER[name])
    assert system_tokens > 80
    [(_, usage, _)] = converse(server, [OTHER[name]], extra)
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["prompt_tokens_details"]["cached_tokens"] >= system_tokens, \
        f"{system_tokens} system prompt tokens, {usage}"


def test_ollama_done_record_counts_cached_prompt_tokens(smol):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    body = {"model": smol.model, "messages": messages, "stream": False, "options": {"num_predict": 4}}
    httpx.post(f"{smol.url}/api/chat", json=body, timeout=120)
    again = httpx.post(f"{smol.url}/api/chat", json=body, timeout=120).json()
    assert again["prompt_cached_count"] > 80
    assert again["prompt_eval_count"] == 0  # the whole prompt was checkpointed, with its logits
    messages[1]["content"] = "Hello again!"
    other = httpx.post(f"{smol.url}/api/chat", json=body, timeout=120).json()
    assert other["prompt_cached_count"] > 80 and other["prompt_eval_count"] > 0  # the system prompt's checkpoint
