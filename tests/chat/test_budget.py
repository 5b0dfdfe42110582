"""The reasoning budget (in process, on the random-weights Qwen3.5 chat model, which never closes
its reasoning by itself): the think block is closed after exactly the budget's tokens, the answer
follows under its grammar, and a forced answer keeps its room without any budget asked."""

import json

import pytest

from pagelm.chat.budget import FORCED_ANSWER_TOKENS, ReasoningBudget, reasoning_limit
from pagelm.chat.conversation import Conversation
from pagelm.chat.grammar import Grammar
from pagelm.engine.sampling import SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"],
          "additionalProperties": False}


@pytest.mark.parametrize("max_tokens, budget, forced, limit", [
    (200, None, False, None), (200, 7, False, 7), (200, None, True, 100), (200, 7, True, 7),
    (2048, None, True, 2048 - FORCED_ANSWER_TOKENS), (2048, 5000, True, 2048 - FORCED_ANSWER_TOKENS), (1, None, True, 1),
])
def test_the_limit_keeps_a_forced_answer_its_room(max_tokens, budget, forced, limit):
    assert reasoning_limit(max_tokens, budget, forced) == limit


def _turn(chat, params, grammar=None):
    conversation = Conversation(chat.model, chat.tokenizer, chat.template, max_len=512, think=True)
    for _ in conversation.ask("Who was the first person on the Moon?", params, grammar=grammar):
        pass
    return conversation.last


@pytest.mark.parametrize("budget", [0, 1, 9])
def test_the_think_block_closes_after_exactly_the_budget(qwen35_chat, budget):
    tokenizer = qwen35_chat.tokenizer
    close = tokenizer.encode("</think>\n\n")
    turn = _turn(qwen35_chat, SamplingParams(temperature=0.8, seed=3, max_tokens=budget + 12, reasoning_budget=budget))
    assert turn.token_ids[budget:budget + len(close)] == close
    assert close[0] not in turn.token_ids[:budget]
    assert turn.content  # the answer after the forced close


def test_without_a_budget_the_random_model_thinks_to_the_end(qwen35_chat):
    turn = _turn(qwen35_chat, SamplingParams(temperature=0.8, seed=3, max_tokens=40))
    assert turn.content == "" and turn.finish_reason == "length"


def test_a_forced_json_answer_arrives_with_no_budget_asked(qwen35_chat):
    grammar = Grammar.json_schema(qwen35_chat.tokenizer, PERSON)
    turn = _turn(qwen35_chat, SamplingParams(temperature=0.8, seed=5, max_tokens=100), grammar)
    assert turn.reasoning and isinstance(json.loads(turn.content)["name"], str)
    close = qwen35_chat.tokenizer.encode("</think>\n\n")
    assert turn.token_ids[50:52] == close  # of 100 tokens, 50 of reasoning, the rest kept for the answer


def test_a_budget_sees_a_close_of_the_models_own_and_then_stays_out_of_the_way(qwen35_chat):
    tokenizer = qwen35_chat.tokenizer
    budget = ReasoningBudget(tokenizer, 3)
    for token in tokenizer.encode("hmm</think>\n\nThe answer is long"):
        budget.accept(token)
    assert budget.closed and not budget.forcing
