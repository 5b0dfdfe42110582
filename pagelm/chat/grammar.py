"""Constrained decoding: JSON schemas and Lark grammars compiled by llguidance into token masks.

Owns the bridge from pagelm's Tokenizer to llguidance's (every token's bytes, the stop tokens)
and one generation's mask → sample → accept state; which schema a request asks for belongs to the
APIs, the decode loop to the engine.

llguidance was chosen by measurement (bench/grammar_mask.py, docs/results.md "Constrained
decoding") and because tool calls need Lark grammars that embed JSON schemas (`%json{...}`).
"""

from __future__ import annotations

import json
import threading
import weakref
from functools import cached_property

import jsonschema
import llguidance
import numpy as np

from pagelm.chat import harmony
from pagelm.chat.reasoning import THINK_END
from pagelm.chat.schema_bounds import bounded_schema
from pagelm.chat.tokenizer import Tokenizer, byte_alphabet
from pagelm.errors import PagelmError

MAX_GRAMMAR_BYTES = 64 << 10

# Compact JSON only: with llguidance's default (any run of whitespace between tokens) a model,
# a random-weight one above all, can emit newlines and spaces until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(PagelmError):
    """A schema or grammar that cannot be compiled (the message says why), or a constraint that broke."""


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """The bytes each token id stands for (a control token: its text).

    Byte-level BPE vocabularies spell bytes in GPT-2's alphabet; SentencePiece ones (built on HF
    `tokenizers` with a non-byte-level decoder) spell a space `▁` and a raw byte `<0xNN>`.
    """
    spelling, alphabet = byte_alphabet()
    unspell = {ord(char): byte for byte, char in spelling.items()}
    sentencepiece = tokenizer.hf is not None and type(tokenizer.hf.decoder).__name__ != "ByteLevel"
    out = []
    for i in range(tokenizer.vocab_size):
        text = tokenizer.id_to_token(i) or ""
        if sentencepiece:
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">") and not tokenizer.is_special(i):
                out.append(bytes([int(text[3:5], 16)]))
            else:
                out.append(text.replace("\u2581", " ").encode())
        elif alphabet.issuperset(text):
            out.append(text.translate(unspell).encode("latin-1"))
        else:  # an added token stored as its own text
            out.append(text.encode())
    return out


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads from a tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokens = token_bytes(tokenizer)
        self.eos_token_id = tokenizer.eos_ids[0]
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        self._tokenizer = weakref.ref(tokenizer)  # the cache below is keyed weakly by the tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer().encode(text.decode("utf-8", "replace"))


_lock = threading.Lock()
_ll_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for `tokenizer`, built once: for Qwen3.5's 248,320 tokens about 1 s and
    90 MiB (its token trie and the per-slice token sets that keep masks inside JSON strings at tens
    of µs; without them 3-5 ms)."""
    with _lock:
        built = _ll_tokenizers.get(tokenizer)
        if built is None:
            if not tokenizer.eos_ids:
                raise GrammarError(f"{tokenizer.name}: no end-of-sequence token, so a constrained answer could never end")
            vocabulary = _Vocabulary(tokenizer)
            wrapper = llguidance.TokenizerWrapper(vocabulary)
            built = llguidance.LLTokenizer(wrapper, eos_token=list(tokenizer.eos_ids))
            # the bytes are copied into llguidance's token trie: the Python copies (13 MiB for
            # Qwen3.5) are not read again
            wrapper.tokens = vocabulary.tokens = ()
            _ll_tokenizers[tokenizer] = built
        return built


class Grammar:
    """A compiled constraint for one tokenizer; immutable, shared by any number of generations."""

    def __init__(self, tokenizer: Tokenizer, grammar: str, is_json: bool = False):
        """`grammar`: llguidance's top-level grammar JSON (use json_schema() or lark()); is_json: it
        is a JSON answer (in harmony, the final channel's message)."""
        self._tokenizer = tokenizer
        self._is_json = is_json
        self._ll_tokenizer = ll_tokenizer(tokenizer)
        self._grammar = grammar
        self._answer = self._compile(grammar)  # compile errors surface here, not at the first request

    @classmethod
    def json_schema(cls, tokenizer: Tokenizer, schema: dict | None) -> Grammar:
        """Compact JSON valid under `schema`, with its open-ended numbers and strings bounded
        (chat.schema_bounds) so that an answer can close; None: any JSON object."""
        if schema is None:
            schema = {"type": "object"}
        check_schema(schema)
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"the JSON schema is not JSON: {e}") from None
        _check_size("JSON schema", text)
        return cls(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(bounded_schema(schema)),
                                                                            overrides=JSON_OPTIONS), is_json=True)

    @classmethod
    def lark(cls, tokenizer: Tokenizer, text: str) -> Grammar:
        """llguidance's Lark dialect (https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md);
        `%json {...}` embeds a JSON schema; llguidance compiles it with its default options (any
        whitespace) unless the schema carries `"x-guidance": JSON_OPTIONS` as json_schema() applies."""
        if not isinstance(text, str):
            raise GrammarError(f"a Lark grammar must be text, got {type(text).__name__}")
        _check_size("Lark grammar", text)
        return cls(tokenizer, json.dumps({"grammars": [{"lark_grammar": text}]}))

    def matcher(self, after_reasoning: bool = False, harmony: bool = False) -> Matcher:
        """A fresh state for one generation; after_reasoning: the constraint starts only once the
        output has closed the reasoning block the prompt left open (with `</think>`); harmony: after
        an analysis message (gpt-oss reasons first), a JSON answer as the final channel's message,
        a Lark grammar (a forced call) writing its own header."""
        compiled = self._after_analysis if harmony else self._after_reasoning if after_reasoning else self._answer
        return Matcher(compiled.deep_copy(), self._ll_tokenizer.vocab_size)

    @cached_property
    def _after_analysis(self) -> llguidance.LLMatcher:
        return self._prefixed(harmony.analysis_first(final=self._is_json))

    @cached_property
    def _after_reasoning(self) -> llguidance.LLMatcher:
        # free text up to and including the first </think>, the blank line templates write after
        # it, then the grammar as a sub-grammar
        close = self._tokenizer.token_to_id(THINK_END)
        if close is not None and self._tokenizer.is_special(close):
            start = f'start: /(.|\\n)*/ <[{close}]> "\\n\\n"? @answer'
        else:
            start = f'start: reasoning "\\n\\n"? @answer\nreasoning[suffix="{THINK_END}"]: /(.|\\n)*/'
        return self._prefixed(start)

    def _prefixed(self, start: str) -> llguidance.LLMatcher:
        """The grammar as the sub-grammar `answer` of the Lark rules `start`."""
        answer, *rest = json.loads(self._grammar)["grammars"]
        return self._compile(json.dumps({"grammars": [{"lark_grammar": start}, {**answer, "name": "answer"}, *rest]}))

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"cannot compile the constraint: {matcher.get_error()}")
        return matcher


class Matcher:
    """One generation's place in a grammar: mask the logits, then accept the sampled token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self._bits = np.zeros((vocab_size + 31) // 32, np.int32)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` (modified in place) with every token the grammar forbids at -inf. Where the
        grammar is complete, the stop tokens are allowed; once nothing else can follow, only they."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        allowed = np.unpackbits(self._bits.view(np.uint8), count=logits.size, bitorder="little").view(bool)
        np.putmask(logits, ~allowed, -np.inf)
        return logits

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)
        self._check()

    @property
    def done(self) -> bool:
        """A stop token has been accepted, or the grammar can take nothing more."""
        return self._matcher.is_stopped()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"constrained decoding failed: {self._matcher.get_error()}")


def check_schema(schema, what: str = "the JSON schema") -> None:
    """Refuse what JSON Schema's (2020-12) meta-schema refuses, saying where: the bounds and
    grammars built from a schema read its keywords as the meta-schema types them."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be an object, got {type(schema).__name__}")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "/".join(map(str, e.absolute_path))
        raise GrammarError(f"{what} is not a valid JSON schema: {e.message}" + (f" (at {at})" if at else "")) from None


def _check_size(what: str, text: str) -> None:
    size = len(text.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the {what} is {size} bytes, more than the limit of {MAX_GRAMMAR_BYTES}")
