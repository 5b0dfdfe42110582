"""Constrained decoding (pagelm.chat.grammar over llguidance): compile errors, the masks, the reasoning
left free, and answers that parse and validate on the real SmolLM2 and the random-weight Qwen3.5."""

import itertools
import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import jsonschema
import numpy as np
import pytest

from pagelm.chat.conversation import Conversation
from pagelm.chat.schema_bounds import MAX_MAGNITUDE, MAX_STRING_CHARS, NUMBER_STEP, bounded_schema
from pagelm.chat.model import ChatModel
from pagelm.chat.tokenizer import Tokenizer
from pagelm.errors import PagelmError
from pagelm.formats.gguf import GGUFFile
from pagelm.chat.grammar import JSON_OPTIONS, MAX_GRAMMAR_BYTES, Grammar, GrammarError, token_bytes
from pagelm.engine.sampling import Sampler, SamplingParams

# Every string, number and array bounded: a random-weight model ends it within max_tokens only
# because the grammar forces the closing quote / bracket at the bound (see docs/results.md).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "status": {"enum": ["active", "inactive"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "status", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(params=["smollm2_chat", "qwen35_chat"])
def chat(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("gguf", ["smollm2_gguf", "qwen35_chat_gguf", "gemma3_gguf"])
def test_token_bytes_are_what_the_tokenizer_decodes(request, gguf):
    # byte-level BPE on HF tokenizers, on pagelm's own _ByteBPE, and SentencePiece (Gemma 3)
    with GGUFFile.open(request.getfixturevalue(gguf)) as file:
        tok = Tokenizer.from_gguf(file)
    spelled = token_bytes(tok)
    assert len(spelled) == tok.vocab_size
    differing = [i for i in range(tok.vocab_size)
                 if not tok.is_special(i) and spelled[i].decode("utf-8", "replace") != tok.decode([i])]
    assert differing == []
    assert spelled[tok.encode("\n")[0]] == b"\n" and spelled[tok.encode(" the")[0]] == b" the"


@pytest.mark.parametrize("schema, named", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "string", "format": "bogus"}, "bogus"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)a"}}}, "look-around"),
    ({"type": "wrong"}, "wrong"),
    (["type", "object"], "must be an object"),
    ({"type": "object", "description": "x" * MAX_GRAMMAR_BYTES}, f"limit of {MAX_GRAMMAR_BYTES}"),
    ({"type": [{}]}, r"not a valid JSON schema: \[\{\}\] is not valid .* \(at type\)"),
    ({"type": "object", "required": [{"a": 1}]}, r"not a valid JSON schema: .* \(at required/0\)"),
    ({"type": "object", "properties": {"a": {"minimum": "one"}}}, "at properties/a/minimum"),
    ({"type": "object", "x-note": {"type": [{}]}}, None),  # a keyword the meta-schema leaves alone compiles
])
def test_schemas_that_cannot_compile_name_the_problem(smollm2_chat, schema, named):
    if named is None:
        Grammar.json_schema(smollm2_chat.tokenizer, schema)
        return
    with pytest.raises(GrammarError, match=named) as caught:
        Grammar.json_schema(smollm2_chat.tokenizer, schema)
    assert isinstance(caught.value, PagelmError)


@pytest.mark.parametrize("text, named", [
    ('start: greeting "!"', "unknown name"),
    ("start: " + '"a" | ' * (MAX_GRAMMAR_BYTES // 6) + '"b"', f"limit of {MAX_GRAMMAR_BYTES}"),
])
def test_lark_grammars_that_cannot_compile_name_the_problem(smollm2_chat, text, named):
    with pytest.raises(GrammarError, match=named):
        Grammar.lark(smollm2_chat.tokenizer, text)


def _allowed(masked: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(masked)).tolist())


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=40),
    SamplingParams(temperature=2.0, min_p=0.05),
    SamplingParams(temperature=1.5, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
], ids=["greedy", "top_p", "top_k", "min_p", "penalties"])
def test_masked_tokens_are_never_sampled(smollm2_chat, params):
    tok = smollm2_chat.tokenizer
    grammar = Grammar.lark(tok, 'start: "yes" | "no"')
    favourite = tok.encode("maybe")[0]
    for seed in range(20):
        logits = np.random.default_rng(seed).normal(0, 3, tok.vocab_size).astype(np.float32)
        logits[favourite] = 50.0  # the model's clear favourite, which the grammar forbids
        masked = grammar.matcher().mask(logits.copy())
        allowed = _allowed(masked)
        texts = {tok.decode([i]) for i in allowed}
        assert {t[:1] for t in texts} == {"y", "n"} and all("yes".startswith(t) or "no".startswith(t) for t in texts)
        sampler = Sampler(replace(params, seed=seed))
        token = sampler.sample(masked, 0, Counter({favourite: 3, min(allowed): 1}))
        assert token in allowed
        if params.temperature == 0:
            assert token == max(allowed, key=lambda i: logits[i])


def test_a_complete_answer_is_done_and_allows_only_the_stop_tokens(smollm2_chat):
    tok = smollm2_chat.tokenizer
    matcher = Grammar.lark(tok, 'start: "yes" | "no"').matcher()
    for token in tok.encode("yes"):
        assert not matcher.done and np.isfinite(matcher.mask(np.zeros(tok.vocab_size, np.float32))[token])
        matcher.accept(token)
    assert _allowed(matcher.mask(np.zeros(tok.vocab_size, np.float32))) == set(tok.eos_ids)
    assert matcher.done  # nothing but a stop token can follow
    matcher.accept(tok.eos_ids[0])
    with pytest.raises(GrammarError):
        matcher.accept(tok.encode("no")[0])


def test_after_reasoning_the_thinking_is_free_and_the_answer_constrained(qwen35_chat):
    tok = qwen35_chat.tokenizer
    grammar = Grammar.json_schema(tok, None)
    zeros = np.zeros(tok.vocab_size, np.float32)
    hello, brace = tok.encode("Hello")[0], tok.encode("{")[0]
    assert not np.isfinite(grammar.matcher().mask(zeros.copy())[hello])  # no reasoning: JSON from the start

    matcher = grammar.matcher(after_reasoning=True)
    for token in tok.encode("Let me think: {[ is not JSON.\n\n"):
        allowed = _allowed(matcher.mask(zeros.copy()))
        assert len(allowed) > 0.99 * tok.vocab_size and hello in allowed and token in allowed
        assert not allowed & set(tok.eos_ids)  # the answer cannot end inside the reasoning
        matcher.accept(token)
    close = tok.token_to_id("</think>")
    assert np.isfinite(matcher.mask(zeros.copy())[close])
    matcher.accept(close)
    allowed = _allowed(matcher.mask(zeros.copy()))
    assert brace in allowed and hello not in allowed
    assert all(tok.decode([i]).startswith(("{", "\n")) for i in allowed)  # the blank line templates write
    _walk(matcher, tok, '\n\n{"a":1}')
    assert _allowed(matcher.mask(zeros.copy())) == set(tok.eos_ids)


def _walk(matcher, tok, text: str) -> None:
    """Feed `text`'s tokens, each one checked to be allowed first."""
    for token in tok.encode(text):
        assert np.isfinite(matcher.mask(np.zeros(tok.vocab_size, np.float32))[token]), tok.decode([token])
        matcher.accept(token)


def test_a_lark_grammar_embedding_a_schema_constrains_after_reasoning(qwen35_chat):
    tok = qwen35_chat.tokenizer
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "x-guidance": JSON_OPTIONS}
    grammar = Grammar.lark(tok, r'start: "<tool_call>\n" %json ' + json.dumps(schema) + r' "\n</tool_call>"')
    matcher = grammar.matcher(after_reasoning=True)
    _walk(matcher, tok, "The weather where?\n</think>")
    allowed = {tok.decode([i]) for i in _allowed(matcher.mask(np.zeros(tok.vocab_size, np.float32)))}
    assert "<tool_call>" in allowed and all("<tool_call>".startswith(t) or "\n\n".startswith(t) for t in allowed)
    _walk(matcher, tok, "\n\n")
    allowed = {tok.decode([i]) for i in _allowed(matcher.mask(np.zeros(tok.vocab_size, np.float32)))}
    assert "<tool_call>" in allowed and all("<tool_call>".startswith(t) for t in allowed)
    _walk(matcher, tok, '<tool_call>\n{"city":')
    assert not np.isfinite(matcher.mask(np.zeros(tok.vocab_size, np.float32))[tok.encode(" ")[0]])  # compact
    _walk(matcher, tok, '"Paris"}\n</tool_call>')
    assert matcher.done and _allowed(matcher.mask(np.zeros(tok.vocab_size, np.float32))) == set(tok.eos_ids)


def _answers(chat: ChatModel, grammar: Grammar, question: str, temperature: float, max_tokens: int,
             system: str | None = None):
    for seed in range(20):
        conversation = Conversation(chat.model, chat.tokenizer, chat.template, max_len=512, system=system)
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)
        content = "".join(c for _, c in conversation.ask(question, params, grammar=grammar))
        assert np.isfinite(conversation.session.logits).all()  # masked a copy: the session keeps the model's own
        yield conversation.last.finish_reason, content


def test_schema_answers_parse_and_validate_20_of_20(chat):
    grammar = Grammar.json_schema(chat.tokenizer, PERSON)
    for finish, content in _answers(chat, grammar, "Describe a person as JSON.", 0.8, 200):
        assert finish == "stop", content
        jsonschema.validate(json.loads(content), PERSON)


def test_json_object_answers_parse_20_of_20(smollm2_chat):
    # Any JSON object is unbounded: it ends when the model ends it. Random weights (the synthetic
    # Qwen3.5) never close a string; SmolLM2 does when the prompt shows a short answer (without
    # one, 16 of 20 seeds: the others repeat items until max_tokens).
    grammar = Grammar.json_schema(smollm2_chat.tokenizer, None)
    system = 'You answer with one short JSON object, for example {"name": "Marie Curie", "age": 66}.'
    for finish, content in _answers(smollm2_chat, grammar, "Give the name and the age of a famous scientist.", 0.5, 200,
                                    system):
        assert finish == "stop", content
        assert isinstance(json.loads(content), dict)


# The schema a new user tried: no bound on the number, so greedy SmolLM2 wrote
# "population_millions":12122222… until max_tokens cut the JSON.
COUNTRY = {"type": "object", "properties": {"country": {"type": "string"}, "population_millions": {"type": "number"}},
           "required": ["country", "population_millions"], "additionalProperties": False}


def test_open_numbers_and_strings_are_bounded_and_answers_stay_valid_under_the_schema():
    bounded = bounded_schema({**COUNTRY, "properties": {
        **COUNTRY["properties"], "count": {"type": ["integer", "null"], "minimum": 0},
        "code": {"type": "string", "enum": ["a" * 600]}, "type": {"type": "string", "maxLength": 3}}})
    props = bounded["properties"]
    assert props["population_millions"] == {"type": "number", "minimum": -MAX_MAGNITUDE, "maximum": MAX_MAGNITUDE,
                                            "multipleOf": NUMBER_STEP}
    assert props["count"] == {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_MAGNITUDE}  # its own bound kept
    assert props["country"] == {"type": "string", "maxLength": MAX_STRING_CHARS}
    assert props["code"] == {"type": "string", "enum": ["a" * 600]} and props["type"]["maxLength"] == 3
    assert bounded["required"] == COUNTRY["required"]


@pytest.mark.parametrize("text, accepted", [
    ('{"country":"France","population_millions":68.4}', True),
    ('{"country":"France","population_millions":-3.123456}', True),
    ('{"country":"France","population_millions":1234567890123456}', False),  # over 10^15
    ('{"country":"France","population_millions":1.1234567}', False),  # a 7th decimal
    ('{"country":"' + "x" * (MAX_STRING_CHARS + 1) + '","population_millions":1}', False),
])
def test_a_schema_grammar_ends_open_numbers_and_strings(smollm2_chat, text, accepted):
    tok = smollm2_chat.tokenizer
    matcher = Grammar.json_schema(tok, COUNTRY).matcher()
    ids = tok.encode(text)
    valid = all(np.isfinite(matcher.mask(np.zeros(tok.vocab_size, np.float32))[i]) and matcher.accept(i) is None
                for i in ids)
    assert valid == accepted
    if accepted:
        jsonschema.validate(json.loads(text), COUNTRY)


def test_an_open_schema_answer_closes_within_max_tokens(smollm2_chat):
    # seeds 0-4 at 0.8: without the bounds, seed 3 wrote a 100-digit population until max_tokens
    grammar = Grammar.json_schema(smollm2_chat.tokenizer, COUNTRY)
    for finish, content in itertools.islice(_answers(smollm2_chat, grammar, "How many people live in Japan, in "
                                                     "millions? JSON please.", 0.8, 160), 5):
        assert finish == "stop", content
        jsonschema.validate(json.loads(content), COUNTRY)


def _run(*args):
    return subprocess.run([sys.executable, "-m", "pagelm", "run", *args], capture_output=True, text=True, timeout=600)


def test_run_json_schema_answers_valid_json(smollm2_gguf, tmp_path):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**9}},
              "required": ["city", "population"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    result = _run(smollm2_gguf, "What is the capital of France? Answer in JSON.", "--json-schema", str(path),
                  "--max-tokens", "60", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["finish_reason"] == "stop"
    jsonschema.validate(json.loads(report["content"]), schema)


def test_run_format_json_answers_a_json_object(smollm2_gguf):
    result = _run(smollm2_gguf, "What is the capital of France? Answer in JSON.", "--format", "json",
                  "--max-tokens", "60")
    assert result.returncode == 0, result.stderr
    assert isinstance(json.loads(result.stdout), dict)


@pytest.mark.parametrize("content, message", [
    (None, "No such file"),
    ('{"type": ', "not valid JSON"),
    ('{"type": "object", "properties": {"a": {"not": {}}}}', '["not"]'),
])
def test_run_rejects_a_bad_schema_file_with_exit_2(smollm2_gguf, tmp_path, content, message):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    result = _run(smollm2_gguf, "Hi", "--json-schema", str(path))
    assert result.returncode == 2 and result.stdout == ""
    assert message in result.stderr


def test_run_help_explains_the_structured_answers():
    result = subprocess.run([sys.executable, "-m", "pagelm", "run", "--help"], capture_output=True, text=True)
    assert "--json-schema FILE" in result.stdout and "--format {json}" in result.stdout
