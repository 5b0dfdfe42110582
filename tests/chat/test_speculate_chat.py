"""Speculation in a conversation (what `pagelm run` and the Python API's chat use): the same answers
with it on and off, a grammar constraining the answer included, with drafts accepted."""

import json

import pytest

from pagelm.chat.conversation import Conversation
from pagelm.chat.grammar import Grammar
from pagelm.engine.sampling import SamplingParams
from pagelm.errors import PagelmError

LIST = "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon"


def _ask(chat, speculate, text, params, grammar=None):
    conversation = Conversation(chat.model, chat.tokenizer, chat.template, max_len=512, speculate=speculate)
    for _ in conversation.ask(text, params, grammar=grammar):
        pass
    return conversation.last


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=48), SamplingParams(temperature=0.6, seed=4, max_tokens=48)])
@pytest.mark.parametrize("constrained", [False, True])
def test_answers_are_the_same_with_speculation_on_and_off(smollm2_chat, params, constrained):
    grammar = None
    text = f"Copy this list exactly: {LIST}"
    if constrained:
        schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
                  "required": ["items"]}
        grammar = Grammar.json_schema(smollm2_chat.tokenizer, schema)
        text = "Copy this JSON exactly: " + json.dumps({"items": LIST.split(", ")}, separators=(",", ":"))
    plain = _ask(smollm2_chat, "off", text, params, grammar)
    speculative = _ask(smollm2_chat, "lookup", text, params, grammar)
    assert speculative.token_ids == plain.token_ids and speculative.content == plain.content
    assert plain.speculation is None and speculative.speculation.accepted > 0, speculative.speculation
    assert _ask(smollm2_chat, "auto", text, params, grammar).token_ids == plain.token_ids  # whatever it measured


def test_an_unknown_mode_is_refused(smollm2_chat):
    with pytest.raises(PagelmError, match="speculate 'fast'"):
        Conversation(smollm2_chat.model, smollm2_chat.tokenizer, smollm2_chat.template, speculate="fast")
