"""Bounds that keep an answer constrained by a JSON schema finite on any model: where the schema
leaves a number's or a string's length open, a grammar would let a model write digits or
characters until max_tokens cuts the JSON. Owns only the rewrite; compiling belongs to grammar.
"""

from __future__ import annotations

from typing import Any

# a raw string value ends by this many characters (also a forced tool call's bound)
MAX_STRING_CHARS = 512
# numbers: |x| <= 10^15 (exact in a double) with at most 6 decimals, so at most 24 characters
MAX_MAGNITUDE = 10**15
NUMBER_STEP = 1e-6

_STRING_SHAPES = ("maxLength", "enum", "const", "pattern", "format")
# keywords whose values are data, not subschemas: never rewritten
_DATA_KEYS = ("enum", "const", "default", "examples", "required", "x-guidance")


def bounded_schema(schema: Any) -> Any:
    """`schema` with every number bounded to ±10^15 and 6 decimals and every string to
    MAX_STRING_CHARS characters where it sets no bound of its own; an answer valid under the
    result is valid under `schema`."""
    if isinstance(schema, list):
        return [bounded_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA_KEYS else bounded_schema(value) for key, value in schema.items()}
    types = schema.get("type")
    # under a keyword JSON Schema does not know (which the meta-schema leaves unchecked) `type` may be anything
    types = {types} if isinstance(types, str) else {t for t in types if isinstance(t, str)} \
        if isinstance(types, list) else set()
    if types & {"number", "integer"}:
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            out["minimum"] = -MAX_MAGNITUDE
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            out["maximum"] = MAX_MAGNITUDE
    if "number" in types and "multipleOf" not in schema:
        out["multipleOf"] = NUMBER_STEP
    if "string" in types and not any(key in schema for key in _STRING_SHAPES):
        out["maxLength"] = MAX_STRING_CHARS
    return out
