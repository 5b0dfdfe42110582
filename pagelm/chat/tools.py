"""Tool calls in a chat template's own words: which form a template writes calls in, reading
calls back out of generated text as it streams, and the grammar that forces a call.

Three forms exist among the templates pagelm knows:
- Qwen3.5's XML form: `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nvalue\\n</parameter>\\n
  </function>\\n</tool_call>`, values written raw (strings as they are, other types as JSON);
- the JSON form of Qwen3 / Qwen2.5 / Hermes-style templates: `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`;
- Llama 3.x's: the whole answer is one call, `{"name": ..., "parameters": {...}}`, without tags;
- LFM2's: a list of calls between its tool-call tokens, `<|tool_call_start|>[get_weather(city="Paris")]
  <|tool_call_end|>`, written as Python calls (LiquidAI's templates) or as JSON objects (llama.cpp's);
- harmony's (gpt-oss): a message to the recipient `functions.NAME` on the commentary channel, its body
  the JSON arguments (`chat.harmony` passes each on in the form its template renders a past call).
A template that renders none has no tool support; the server refuses tools for it.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

from pagelm.chat import harmony
from pagelm.chat.schema_bounds import MAX_STRING_CHARS, bounded_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# bounds that keep a forced call finite on any model, random weights included: a raw string
# value ends by MAX_STRING_CHARS characters, and at most this many calls are forced in one answer
MAX_PARALLEL_CALLS = 4
# JSON inside a call is written the way templates' `tojson` writes it (Python's json.dumps): single
# spaces after , and :, no other whitespace (which a model could otherwise emit without end)
TEMPLATE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, description and the JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def for_template(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    @property
    def properties(self) -> dict:
        props = self.parameters.get("properties")
        return props if isinstance(props, dict) else {}

    @property
    def required(self) -> list[str]:
        required = self.parameters.get("required")
        return [r for r in required if r in self.properties] if isinstance(required, list) else []


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows (empty: any)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    if "enum" in schema and isinstance(schema["enum"], list):
        return {_json_type(v) for v in schema["enum"]}
    if "const" in schema:
        return {_json_type(schema["const"])}
    union = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(union, list):
        return set().union(*(_schema_types(s) for s in union)) if all(_schema_types(s) for s in union) else set()
    return set()


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "string")


def _length_bounds(schema: dict) -> tuple[int, int]:
    """A string schema's (minLength, maxLength), the maximum capped at MAX_STRING_CHARS."""
    def bound(key: str, default: int) -> int:
        value = schema.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default

    high = min(bound("maxLength", MAX_STRING_CHARS), MAX_STRING_CHARS)
    return min(bound("minLength", 0), high), high


def _embedded(schema: dict) -> str:
    """A schema for Lark's `%json`, with TEMPLATE_JSON's whitespace."""
    return json.dumps({**bounded_schema(schema), "x-guidance": TEMPLATE_JSON})


def _is_raw_string(schema: Any) -> bool:
    """Whether the XML form writes this parameter's value as raw text (a string-only schema)."""
    return _schema_types(schema) == {"string"}


def typed_value(text: str, schema: Any) -> Any:
    """An XML-form parameter value as the type its schema asks for; text when it is not valid
    JSON of an allowed type (nothing is dropped)."""
    if _is_raw_string(schema):
        return text
    types = _schema_types(schema)
    if "boolean" in types and text.strip() in ("True", "False"):  # how a Python template writes bools
        return text.strip() == "True"
    try:
        value = json.loads(text)
    except ValueError:
        return text
    kind = _json_type(value)
    if not types or kind in types or (kind == "integer" and "number" in types):
        return value
    return text


class ToolFormat:
    """How one template family writes a call; subclasses fill in the block's inside."""

    open, close = OPEN, CLOSE  # the tags around a block of calls

    def stream(self, tools: Iterable[Tool]) -> ToolCallStream | AnswerCallStream:
        """What reads this form's calls to `tools` out of a streamed answer."""
        return ToolCallStream(self, tools)

    def parse(self, inner: str, tools: dict[str, Tool]) -> ToolCall | None:
        """The call written between `<tool_call>` and `</tool_call>`; None when it is not one."""
        raise NotImplementedError

    def block_calls(self, inner: str, tools: dict[str, Tool]) -> list[ToolCall] | None:
        """The calls a block between the tags holds; None when it is not a block of calls."""
        call = self.parse(inner, tools)
        return None if call is None else [call]

    def inner_end(self, text: str, start: int) -> int:
        """Where the `</tool_call>` closing the block whose inside begins at `start` is; -1 while
        it has not come. A value inside may itself contain `</tool_call>`, so each form
        finds the end by its own structure."""
        raise NotImplementedError

    def call_rule(self, tools: list[Tool]) -> list[str]:
        """Lark rules defining `call_body`: what a forced call may say between the tags."""
        raise NotImplementedError

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        """An llguidance Lark grammar: one call to one of `tools` (up to MAX_PARALLEL_CALLS when
        `parallel`), nothing else."""
        repeat = f'("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        rules = [f"start: call {repeat}".rstrip(),
                 f"call: {json.dumps(OPEN)} \"\\n\" call_body \"\\n\" {json.dumps(CLOSE)}"]
        return "\n".join(rules + self.call_rule(tools)) + "\n"


PARAMETER_END = json.dumps("\n</parameter>\n")


class QwenXmlFormat(ToolFormat):
    FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.S)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    END = re.compile(r"</function>\s*(?=</tool_call>)")

    def inner_end(self, text: str, start: int) -> int:
        match = self.END.search(text, start)
        return -1 if match is None else match.end()

    def parse(self, inner: str, tools: dict[str, Tool]) -> ToolCall | None:
        match = self.FUNCTION.fullmatch(inner)
        if not match or match.group(1) not in tools:
            return None
        tool = tools[match.group(1)]
        body = match.group(2)
        arguments = {name: typed_value(value, tool.properties.get(name))
                     for name, value in self.PARAMETER.findall(body)}
        if self.PARAMETER.sub("", body).strip():
            return None  # text outside the parameters: not a call this format wrote
        return ToolCall(tool.name, arguments)

    def call_rule(self, tools: list[Tool]) -> list[str]:
        rules = ["call_body: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            params = []
            for j, (name, schema) in enumerate(tool.properties.items()):
                head = json.dumps(f"<parameter={name}>\n")
                rules.append(f"param_{i}_{j}: {head} value_{i}_{j}")
                if _is_raw_string(schema) and isinstance(schema.get("enum"), list):
                    rules.append(f"value_{i}_{j}: (" + " | ".join(json.dumps(str(v)) for v in schema["enum"])
                                 + f") {PARAMETER_END}")
                elif _schema_types(schema) == {"boolean"}:  # the template writes Python's True / False
                    rules.append(f'value_{i}_{j}: ("true" | "false" | "True" | "False") {PARAMETER_END}')
                elif _is_raw_string(schema):
                    # raw text up to the first closing tag (lazy), bounded
                    low, high = _length_bounds(schema)
                    rules.append(f"value_{i}_{j}[suffix={PARAMETER_END}]: RAW_{i}_{j}")
                    rules.append(f"RAW_{i}_{j}: /(?s:.{{{low},{high}}})/")
                else:
                    rules.append(f"value_{i}_{j}: %json {_embedded(schema if isinstance(schema, dict) else {})} "
                                 f"{PARAMETER_END}")
                params.append(f"param_{i}_{j}" + ("" if name in tool.required else "?"))
            head = json.dumps(f"<function={tool.name}>\n")
            rules.append(f'fn_{i}: {head} {" ".join(params)} "</function>"')
        return rules


def _named_call(value: Any, tools: dict[str, Tool]) -> ToolCall | None:
    """A call written as an object `{"name": ..., "arguments" (or "parameters"): {...}}`, the
    arguments possibly as a JSON string; None when `value` is not a call to one of `tools`."""
    if not isinstance(value, dict) or value.get("name") not in tools:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


class JsonFormat(ToolFormat):

    def inner_end(self, text: str, start: int) -> int:
        body = len(text) - len(text[start:].lstrip())
        if not text.startswith("{", body):  # not JSON: the first closing tag ends it
            return text.find(CLOSE, start)
        try:
            _, end = json.JSONDecoder().raw_decode(text, body)
        except ValueError:  # not complete yet (or malformed: then finish() gives it back as content)
            return -1
        end = len(text) - len(text[end:].lstrip())
        return end if text.startswith(CLOSE, end) else text.find(CLOSE, end)

    def parse(self, inner: str, tools: dict[str, Tool]) -> ToolCall | None:
        try:
            value = json.loads(inner)
        except ValueError:
            return None
        return _named_call(value, tools)

    arguments = "arguments"  # the key a call's arguments are written under

    def call_rule(self, tools: list[Tool]) -> list[str]:
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, self.arguments: t.parameters},
                  "required": ["name", self.arguments], "additionalProperties": False} for t in tools]
        return [f"call_body: %json {_embedded({'anyOf': calls})}"]


class Llama3Format(JsonFormat):
    """Llama 3.x: an answer that is a call is only the call, one JSON object, no tags (its
    templates render one call a message)."""

    arguments = "parameters"

    def stream(self, tools: Iterable[Tool]) -> AnswerCallStream:
        return AnswerCallStream(self, tools)

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        return "\n".join(["start: call_body"] + self.call_rule(tools)) + "\n"


JSON_NAMES = {"true": True, "false": False, "null": None}  # JSON's constants, read in Python syntax


def _literal(node: ast.expr, source: str) -> Any:
    """The value a literal expression of `source` writes, JSON's constants included; ValueError
    for anything else (nothing is evaluated)."""
    if isinstance(node, ast.Constant) and type(node.value) in (str, int, float, bool, type(None)):
        written = ast.get_source_segment(source, node) or ""
        if isinstance(node.value, str) and written.startswith('"'):
            try:  # a JSON-written string: its escapes (\/, surrogate pairs) read as JSON reads them
                return json.loads(written)
            except ValueError:
                pass
        return node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)
            and type(node.operand.value) in (int, float)):
        return -node.operand.value
    if isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item, source) for item in node.elts]
    if isinstance(node, ast.Dict) and all(key is not None for key in node.keys):
        keys = [_literal(key, source) for key in node.keys]
        if all(isinstance(key, str) for key in keys):
            return dict(zip(keys, (_literal(value, source) for value in node.values)))
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


def _call_list(text: str) -> ast.List | None:
    """`text` parsed as a Python list expression; None when it is not one."""
    try:
        with warnings.catch_warnings():  # a JSON escape such as \/ is an invalid one in Python: warned about
            warnings.simplefilter("ignore")
            tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return tree if isinstance(tree, ast.List) else None


def _keywords_in_order(params: list[tuple[str, bool]]) -> str:
    """A Lark expression: the (rule, required) keyword arguments in their order, comma-separated,
    each optional one free to be left out; empty when there are none."""
    first, rest = "", ""  # from the current one on: with the first bare / each after ", "
    for rule, required in reversed(params):
        if required:
            first, rest = f"{rule} {rest}", f'", " {rule} {rest}'
        else:
            first = f"({rule} {rest}| {first})" if first else f"({rule} {rest})?"
            rest = f'(", " {rule})? {rest}'
    return first


class Lfm2Format(ToolFormat):
    """LFM2: `<|tool_call_start|>[f(a=1), g()]<|tool_call_end|>`, a Python list of calls with
    keyword arguments (LiquidAI's templates and models), or of JSON call objects (llama.cpp's
    LFM2 template). Read with `ast`, literals only."""

    open, close = "<|tool_call_start|>", "<|tool_call_end|>"

    def inner_end(self, text: str, start: int) -> int:
        end = text.find(self.close, start)
        while end >= 0 and _call_list(text[start:end]) is None:  # a string value may hold the closing tag
            end = text.find(self.close, end + 1)
        return end

    def block_calls(self, inner: str, tools: dict[str, Tool]) -> list[ToolCall] | None:
        listed = _call_list(inner)
        if listed is None or not listed.elts:
            return None
        try:
            calls = [self._call(node, inner.strip(), tools) for node in listed.elts]
        except ValueError:
            return None
        return None if None in calls else calls

    @staticmethod
    def _call(node: ast.expr, source: str, tools: dict[str, Tool]) -> ToolCall | None:
        if not isinstance(node, ast.Call):
            return _named_call(_literal(node, source), tools)
        if not isinstance(node.func, ast.Name) or node.func.id not in tools or node.args \
                or any(kw.arg is None for kw in node.keywords):
            return None
        return ToolCall(node.func.id, {kw.arg: _literal(kw.value, source) for kw in node.keywords})

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        repeat = f'(", " call){{0,{MAX_PARALLEL_CALLS - 1}}} ' if parallel else ""
        rules = [f'start: {json.dumps(self.open + "[")} call {repeat}{json.dumps("]" + self.close)}',
                 "call: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            params = []
            for j, (name, schema) in enumerate(tool.properties.items()):
                rules.append(f"param_{i}_{j}: {json.dumps(name + '=')} "
                             f"%json {_embedded(schema if isinstance(schema, dict) else {})}")
                params.append((f"param_{i}_{j}", name in tool.required))
            rules.append(f'fn_{i}: {json.dumps(tool.name + "(")} {_keywords_in_order(params)}")"')
        return "\n".join(rules) + "\n"


class HarmonyFormat(ToolFormat):
    """gpt-oss: one call a message, `functions.NAME<|channel|>commentary json<|message|>{...}` between
    harmony.CALL_OPEN and harmony.CALL_CLOSE; a forced call's grammar comes after the analysis
    message (Grammar.matcher's `harmony`)."""

    open, close = harmony.CALL_OPEN, harmony.CALL_CLOSE
    CALL = re.compile(r"functions\.([^<\s]+)" + re.escape(harmony.CHANNEL) + r"commentary(?: \w+)?"
                      + re.escape(harmony.MESSAGE) + r"(.*)", re.S)

    def inner_end(self, text: str, start: int) -> int:
        return text.find(self.close, start)

    def parse(self, inner: str, tools: dict[str, Tool]) -> ToolCall | None:
        match = self.CALL.fullmatch(inner)
        if match is None or match.group(1) not in tools:
            return None
        try:
            arguments = json.loads(match.group(2))
        except ValueError:
            return None
        return ToolCall(match.group(1), arguments) if isinstance(arguments, dict) else None

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        """One call (`<|call|>`, a stop token, ends the answer after it: never parallel calls)."""
        channel, constrain, message = harmony.CHANNEL, harmony.CONSTRAIN, harmony.MESSAGE
        rules = ["start: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        rules += [f'fn_{i}: {channel} {json.dumps(f"commentary to=functions.{t.name} ")} {constrain} "json" {message} '
                  f"%json {_embedded(t.parameters)}" for i, t in enumerate(tools)]
        return "\n".join(rules) + "\n"


def tool_format(template_source: str | None) -> ToolFormat | None:
    """The form a chat template writes calls in; None when it renders no calls at all."""
    source = template_source or ""
    if "tool_calls" not in source:
        return None
    if harmony.is_harmony(source):
        return HarmonyFormat()
    if Lfm2Format.open in source:
        return Lfm2Format()
    if OPEN in source:
        return QwenXmlFormat() if "<function=" in source else JsonFormat()
    return Llama3Format() if '"parameters": ' in source else None


class PlainStream:
    """The answer text of a request that offers no tools: all content."""

    calls: tuple[ToolCall, ...] = ()

    def push(self, text: str) -> list[str | ToolCall]:
        return [text] if text else []

    def finish(self) -> list[str | ToolCall]:
        return []


class ToolCallStream:
    """Splits streamed answer text into content and complete tool calls. Text that might begin
    a call is held until it is known; a block that does not parse as a call, or one left open at
    the end, comes back as content, so nothing the model wrote is lost."""

    def __init__(self, form: ToolFormat, tools: Iterable[Tool]):
        self.form = form
        self.tools = {t.name: t for t in tools}
        self.held = ""
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> list[str | ToolCall]:
        self.held += text
        out: list[str | ToolCall] = []
        start_tag, end_tag = self.form.open, self.form.close
        while True:
            start = self.held.find(start_tag)
            if start < 0:
                break
            end = self.form.inner_end(self.held, start + len(start_tag))
            if end < 0:
                self._content(self.held[:start], out, before_call=True)
                self.held = self.held[start:]
                return out
            calls = self.form.block_calls(self.held[start + len(start_tag) : end], self.tools)
            if calls is None:
                self._content(self.held[: end + len(end_tag)], out)
            else:
                self._content(self.held[:start], out, before_call=True)
                self.calls.extend(calls)
                out.extend(calls)
            self.held = self.held[end + len(end_tag) :]
        # keep back a tail that could be the start of the opening tag, and whitespace that may precede a call
        keep = next((k for k in range(min(len(start_tag) - 1, len(self.held)), 0, -1)
                     if self.held.endswith(start_tag[:k])), 0)
        cut = len(self.held) - keep
        cut = len(self.held[:cut].rstrip())
        self._content(self.held[:cut], out)
        self.held = self.held[cut:]
        return out

    def finish(self) -> list[str | ToolCall]:
        held, self.held = self.held, ""
        out: list[str | ToolCall] = []
        if not self.calls or held.strip():
            self._content(held, out)
        return out

    def _content(self, text: str, out: list, before_call: bool = False) -> None:
        if before_call:
            text = text.rstrip()
        if self.calls and not text.strip():
            return  # the separators between calls
        if text:
            out.append(text)


class AnswerCallStream:
    """An answer that is a call when its first non-blank character is `{` (Llama 3.x): held until
    its JSON object is complete, then a call if it is one of the tools' (what follows it is
    content), else content; any other answer is content as it streams."""

    def __init__(self, form: JsonFormat, tools: Iterable[Tool]):
        self.form = form
        self.tools = {t.name: t for t in tools}
        self.held = ""
        self.deciding = True  # until the answer shows whether it is a call
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> list[str | ToolCall]:
        if not self.deciding:
            return [text] if text else []
        self.held += text
        body = self.held.lstrip()
        if not body:
            return []
        if body.startswith("{"):
            try:
                _, end = json.JSONDecoder().raw_decode(body)
            except ValueError:  # not complete yet (or never: finish() gives it back as content)
                return []
            call = self.form.parse(body[:end], self.tools)
            if call is not None:
                self.deciding, self.held = False, ""
                self.calls.append(call)
                rest = body[end:]
                return [call] + ([rest] if rest.strip() else [])
        self.deciding = False
        return self.finish()

    def finish(self) -> list[str | ToolCall]:
        held, self.held = self.held, ""
        return [held] if held else []
