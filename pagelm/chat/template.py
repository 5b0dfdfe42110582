"""Chat templates: render a model's Jinja chat template, safely.

A chat template comes from the model file, so it is untrusted code. It runs in
Jinja's ``ImmutableSandboxedEnvironment`` (no dunder or private attributes, no
mutation of lists/dicts/sets) with the extras Hugging Face templates expect
(``raise_exception``, ``strftime_now``, HF's ``tojson``, ``loopcontrols``,
``{% generation %}``, ``dict``, a namespace that refuses ``_`` names), and on top of the sandbox every
render is bounded:

* every string or list a template builds is at most ``max_len`` long (checked
  *before* the allocation for ``*``, ``**``, ``+``, ``%``, ``~``, ``str.format``,
  ``center``/``ljust``/``rjust``/``zfill``, ``replace``, ``join``, ``tojson``,
  ``indent``, ``format``, ``batch``, ``slice``, ``wordwrap``, ``sum``...);
  integers are at most ``max_int_bits`` bits;
* ``range`` yields at most ``max_range`` items;
* the total text a render produces (output, captured blocks, macro results) and
  the total it allocates are budgeted, and the final prompt is at most
  ``max_output`` characters;
* every loop iteration, call, attribute access, operator and filter is a step:
  at most ``max_steps`` steps and ``timeout_s`` seconds per render (checked
  without threads or signals);
* methods of builtin values are allow-listed (``encode``, ``translate``,
  ``expandtabs``, ``to_bytes``... are refused), ``lipsum``/``pprint`` removed,
  ``include``/``import``/``extends`` have no loader.

Anything refused raises :class:`TemplateError` (or a subclass) naming the model
and what was refused.
"""

from __future__ import annotations

import contextvars
import json
import re
import string as _string
import time
from datetime import datetime
from typing import Any, Iterable, Mapping

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.utils
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateSyntaxError, UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from pagelm.errors import PagelmError

__all__ = [
    "CHATML_TEMPLATE",
    "ChatMessageError",
    "ChatTemplate",
    "TemplateError",
    "TemplateLimitError",
    "TemplateRaisedError",
    "TemplateSecurityError",
    "think_prefix",
]


class TemplateError(PagelmError):
    """A chat template could not be compiled or rendered."""


class TemplateSecurityError(TemplateError):
    """A chat template tried something the sandbox forbids."""


class TemplateLimitError(TemplateError):
    """A chat template exceeded a size, step or time limit."""


class TemplateRaisedError(TemplateError):
    """The template itself refused the conversation (``raise_exception``)."""


class ChatMessageError(PagelmError):
    """The messages (or tools) given to a chat template are malformed."""


# The built-in template for models without one: plain ChatML.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is iterable %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Methods of builtin values a template may call. Starred ones are size-checked.
_STR_METHODS = frozenset(
    "capitalize casefold center count endswith find format format_map index isalnum "
    "isalpha isascii isdecimal isdigit isidentifier islower isnumeric isprintable "
    "isspace istitle isupper join ljust lower lstrip partition removeprefix "
    "removesuffix replace rfind rindex rjust rpartition rsplit rstrip split "
    "splitlines startswith strip swapcase title upper zfill".split()
)
_DICT_METHODS = frozenset("get items keys values".split())
_SEQ_METHODS = frozenset("index count".split())


class _Refused(Exception):
    """Internal: a limit or policy refused an operation (message says which)."""

    def __init__(self, message: str, kind: type[TemplateError] = TemplateLimitError):
        super().__init__(message)
        self.kind = kind


class _NoBudget(Exception):
    """Internal: an accounting filter evaluated at compile time (defers to runtime)."""


class _Budget:
    __slots__ = ("steps", "max_steps", "alloc", "max_alloc", "produced", "max_produced", "deadline")

    def __init__(self, max_steps: int, max_alloc: int, max_produced: int, timeout_s: float):
        self.steps = 0
        self.max_steps = max_steps
        self.alloc = 0
        self.max_alloc = max_alloc
        self.produced = 0
        self.max_produced = max_produced
        self.deadline = time.monotonic() + timeout_s


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("pagelm_template_budget", default=None)


def _step(n: int = 1) -> None:
    b = _BUDGET.get()
    if b is None:
        return
    b.steps += n
    if b.steps > b.max_steps:
        raise _Refused(f"render took more than {b.max_steps:,} steps (runaway loop or recursion?)")
    if (b.steps & 1023) == 0 and time.monotonic() > b.deadline:
        raise _Refused("render exceeded its time limit (runaway loop or recursion?)")


def _charge(value: Any) -> Any:
    """Charge a freshly built value to the allocation budget."""
    b = _BUDGET.get()
    if b is not None and isinstance(value, (str, list, tuple, dict, set, frozenset)):
        b.alloc += len(value)
        if b.alloc > b.max_alloc:
            raise _Refused(f"render allocated more than {b.max_alloc:,} characters/items in total")
    return value


def _produce(n: int) -> None:
    b = _BUDGET.get()
    if b is None:
        raise _NoBudget()
    b.produced += n
    if b.produced > b.max_produced:
        raise _Refused(f"render produced more than {b.max_produced:,} characters in total")


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attribute names (as HF's does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} starts with an underscore")


def _namespace_attrs(ns: jinja2.utils.Namespace) -> dict:
    return object.__getattribute__(ns, "_Namespace__attrs")


class _TemplateDict:
    """``dict`` for templates, without the type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _SandboxTransformer(NodeTransformer):
    """Routes loops, ``~`` and literal text through accounting filters."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "__pagelm_iter", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        items = nodes.List(list(node.nodes), lineno=node.lineno)
        return nodes.Filter(items, "__pagelm_concat", [], [], None, None, lineno=node.lineno)

    def visit_TemplateData(self, node: nodes.TemplateData) -> nodes.Node:
        return nodes.Filter(nodes.Const(node.data, lineno=node.lineno), "__pagelm_data", [], [], None, None,
                            lineno=node.lineno)


class _CodeGenerator(CodeGenerator):
    def visit_Template(self, node: nodes.Template, frame: Any = None) -> None:
        _SandboxTransformer().visit(node)
        super().visit_Template(node, frame)


class _GenerationBlock(jinja2.ext.Extension):
    """Hugging Face's ``{% generation %}...{% endgeneration %}``, which marks the assistant's own
    text for training masks: rendered, it is its body in a scope of its own."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

    def __init__(self, *, max_len: int, max_int_bits: int, max_range: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols,
                                                                              _GenerationBlock])
        self.max_len = max_len
        self.max_int_bits = max_int_bits
        self.max_range = max_range
        self.finalize = self._finalize
        self.globals.pop("lipsum", None)
        self.globals.update(
            range=self._range,
            dict=_TemplateDict(),
            namespace=_Namespace,
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
        )
        filters = {name: f for name, f in self.filters.items() if name not in ("pprint",)}
        filters["tojson"] = self._tojson
        filters["center"] = self._checked(jinja2.filters.do_center, width=1)
        filters["indent"] = self._indent
        filters["format"] = self._format_filter
        filters["replace"] = self._replace_filter
        filters["join"] = self._join_filter
        filters["wordwrap"] = self._wordwrap
        filters["batch"] = self._checked(jinja2.filters.do_batch, width=1)
        filters["slice"] = self._checked(jinja2.filters.do_slice, width=1)
        filters["sum"] = self._sum_filter
        filters["string"] = self._string_filter
        self.filters = {name: self._wrap_filter(name, f) for name, f in filters.items()}
        self.filters["__pagelm_iter"] = self._iter
        self.filters["__pagelm_concat"] = self._concat
        self.filters["__pagelm_data"] = self._data

    # -- size helpers --------------------------------------------------------------

    def _refuse_len(self, what: str, n: int) -> None:
        if n > self.max_len:
            raise _Refused(f"{what} would be {n:,} long (limit {self.max_len:,})")

    def _int(self, value: Any, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            return 0
        if value > self.max_len:
            raise _Refused(f"{what} {value:,} is over the limit {self.max_len:,}")
        return value

    def _repr_len(self, value: Any, limit: int, as_str: bool) -> int:
        """Upper bound of len(str(value)) (as_str) or len(repr(value)), stopping past limit."""
        total = 0
        stack = [(value, as_str)]
        while stack:
            v, top = stack.pop()
            if isinstance(v, str):
                total += len(v) if top else (len(v) * 10 + 2 if len(v) > limit else len(repr(v)))
            elif v is None or isinstance(v, (bool, int, float)):
                if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > self.max_int_bits:
                    raise _Refused(f"integer of {v.bit_length():,} bits (limit {self.max_int_bits:,})")
                total += 24 if not isinstance(v, int) else len(str(v))
            elif isinstance(v, Mapping):
                total += 2 + 4 * len(v)
                for k, item in v.items():
                    stack.append((k, False))
                    stack.append((item, False))
            elif isinstance(v, jinja2.utils.Namespace):
                total += 14
                stack.append((_namespace_attrs(v), False))
            elif isinstance(v, (list, tuple, set, frozenset)):
                total += 2 + 2 * len(v)
                stack.extend((item, False) for item in v)
            else:
                total += len(str(v)) if top else len(repr(v))
            if total > limit:
                return total
        return total

    def _to_str(self, value: Any, what: str) -> str:
        if isinstance(value, str):
            return value
        n = self._repr_len(value, self.max_len, True)
        self._refuse_len(what, n)
        return str(value)

    def _check_result(self, value: Any, what: str) -> Any:
        if isinstance(value, (str, list, tuple, dict, set, frozenset)):
            self._refuse_len(what, len(value))
        elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > self.max_int_bits:
            raise _Refused(f"{what} would be an integer of {value.bit_length():,} bits (limit {self.max_int_bits:,})")
        return _charge(value)

    def _check_printf(self, fmt: str, args: Any) -> None:
        if "*" in re.sub(r"%%", "", fmt):
            raise _Refused("'*' widths in %-formatting", TemplateSecurityError)
        widths = sum(int(w) for w in re.findall(r"%[-#0 +(\w)]*?(\d+)", fmt))
        widths += sum(int(w) for w in re.findall(r"\.(\d+)", fmt))
        self._refuse_len("%-format width", widths)
        n = len(fmt) + widths + 2 * self._repr_len(args, self.max_len, True)
        self._refuse_len("%-formatted string", n)

    def _check_format_spec(self, fmt: str, args: tuple, kwargs: Mapping) -> None:
        try:
            fields = list(_string.Formatter().parse(fmt))
        except ValueError as exc:
            raise _Refused(f"bad format string: {exc}") from None
        arg_len = self._repr_len((args, dict(kwargs)), self.max_len, True)
        self._refuse_len("format() arguments", arg_len)
        n = len(fmt)
        for _lit, field, spec, _conv in fields:
            if field is None:
                continue
            if spec and "{" in spec:
                raise _Refused("nested replacement fields in a format spec", TemplateSecurityError)
            width = sum(int(w) for w in re.findall(r"\d+", spec or ""))
            self._refuse_len("format width", width)
            n += width + arg_len
            self._refuse_len("formatted string", n)

    # -- sandbox hooks -------------------------------------------------------------

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _step()
        seq = (str, list, tuple)
        if operator == "*":
            for a, b in ((left, right), (right, left)):
                if isinstance(a, seq) and isinstance(b, int):
                    self._refuse_len("repetition result", len(a) * max(b, 0))
            if isinstance(left, int) and isinstance(right, int):
                bits = left.bit_length() + right.bit_length()
                if bits > self.max_int_bits:
                    raise _Refused(f"integer product of about {bits:,} bits (limit {self.max_int_bits:,})")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0:
                bits = max(left.bit_length() - 1, 0) * right
                if abs(left) > 1 and bits > self.max_int_bits:
                    raise _Refused(f"integer power of about {bits:,} bits (limit {self.max_int_bits:,})")
        elif operator == "+":
            if isinstance(left, seq) and isinstance(right, seq):
                self._refuse_len("concatenation result", len(left) + len(right))
        elif operator == "%" and isinstance(left, str):
            self._check_printf(left, right)
        return self._check_result(super().call_binop(context, operator, left, right), f"'{operator}' result")

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Jinja returns an Undefined that prints as "": refuse loudly instead.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _step()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__
        is_map = value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            if is_map:
                self._check_format_spec(fmt, (), args[0] if args and isinstance(args[0], Mapping) else {})
            else:
                self._check_format_spec(fmt, args, kwargs)
            return wrapped(*args, **kwargs)

        checked.__name__ = value.__name__
        checked.__self__ = fmt  # type: ignore[attr-defined]
        return checked

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _step()
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "?")
        if owner is not None and isinstance(owner, (str, bytes, int, float, list, tuple, dict, set, frozenset)):
            if isinstance(owner, str):
                allowed = _STR_METHODS
            elif isinstance(owner, dict):
                allowed = _DICT_METHODS
            elif isinstance(owner, (list, tuple)):
                allowed = _SEQ_METHODS
            else:
                allowed = frozenset()
            if name not in allowed:
                raise _Refused(f"calling {type(owner).__name__}.{name}() is not allowed in a chat template",
                               TemplateSecurityError)
            if isinstance(owner, str):
                args = __self._precheck_str_method(owner, name, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return __self._check_result(result, f"result of {name}()")

    def _precheck_str_method(self, s: str, name: str, args: tuple, kwargs: dict) -> tuple:
        if name in ("center", "ljust", "rjust", "zfill"):
            width = args[0] if args else kwargs.get("width", 0)
            self._int(width, f"{name}() width")
        elif name == "replace":
            old = args[0] if args else kwargs.get("old", "")
            new = args[1] if len(args) > 1 else kwargs.get("new", "")
            if isinstance(old, str) and isinstance(new, str):
                count = s.count(old) if old else len(s) + 1
                limit = args[2] if len(args) > 2 else kwargs.get("count", -1)
                if isinstance(limit, int) and limit >= 0:
                    count = min(count, limit)
                self._refuse_len("replace() result", len(s) + count * max(len(new) - len(old), 0))
        elif name == "join":
            items = self._materialize(args[0]) if args else ()
            args = (items,) + tuple(args[1:])
            self._join_estimate(s, items)
        return args

    def _materialize(self, items: Any) -> Any:
        """A generator (``map``, ``select``...) as a list, at most ``max_len`` items."""
        if isinstance(items, (list, tuple, str, dict, set, frozenset)) or isinstance(items, jinja2.Undefined):
            return items
        out = []
        for item in items:
            _step()
            out.append(item)
            self._refuse_len("sequence", len(out))
        return out

    def _join_estimate(self, sep: str, items: Any) -> None:
        if not isinstance(items, (list, tuple, str, dict, set, frozenset)):
            return
        total = len(sep) * max(len(items) - 1, 0)
        self._refuse_len("join() result", total)
        for item in items:
            total += len(item) if isinstance(item, str) else self._repr_len(item, self.max_len, True)
            self._refuse_len("join() result", total)

    # -- globals and filters -------------------------------------------------------

    def _range(self, *args: int) -> range:
        rng = range(*args)
        if len(rng) > self.max_range:
            raise _Refused(f"range() of {len(rng):,} items (limit {self.max_range:,})")
        return rng

    def _finalize(self, value: Any) -> str:
        text = self._to_str(value, "output value") if value is not None else "None"
        b = _BUDGET.get()
        if b is not None:
            _step()
            _produce(len(text))
        return text

    @staticmethod
    def _iter(value: Any) -> Iterable:
        if _BUDGET.get() is None:
            raise _NoBudget()  # never folded at compile time
        return _counted(value)

    def _concat(self, values: list) -> str:
        if _BUDGET.get() is None:
            raise _NoBudget()
        _step()
        parts = []
        total = 0
        for v in values:
            s = self._to_str(v, "'~' operand")
            total += len(s)
            self._refuse_len("'~' result", total)
            parts.append(s)
        return _charge("".join(parts))

    @staticmethod
    def _data(value: str) -> str:
        _produce(len(value))  # raises _NoBudget at compile time: stays a runtime call
        _step()
        return value

    def _wrap_filter(self, name: str, func: Any) -> Any:
        env = self

        def filtered(*args: Any, **kwargs: Any) -> Any:
            _step()
            return env._check_result(func(*args, **kwargs), f"result of filter '{name}'")

        for attr in ("jinja_pass_arg", "jinja_async_variant"):
            if hasattr(func, attr):
                setattr(filtered, attr, getattr(func, attr))
        filtered.__name__ = getattr(func, "__name__", name)
        return filtered

    def _checked(self, func: Any, width: int) -> Any:
        env = self
        pass_arg = getattr(func, "jinja_pass_arg", None)
        skip = 1 if pass_arg is not None else 0

        def checked(*args: Any, **kwargs: Any) -> Any:
            if len(args) > skip + width:
                env._int(args[skip + width], f"{func.__name__.removeprefix('do_')} argument")
            for value in kwargs.values():
                env._int(value, f"{func.__name__.removeprefix('do_')} argument")
            return func(*args, **kwargs)

        if pass_arg is not None:
            checked.jinja_pass_arg = pass_arg  # type: ignore[attr-defined]
        checked.__name__ = func.__name__
        return checked

    def _tojson(self, value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                sort_keys: bool = False) -> str:
        """HF's ``tojson``: ``json.dumps`` without HTML escaping, size-bounded."""
        if isinstance(indent, int):
            self._int(indent, "tojson indent")
        elif isinstance(indent, str):
            self._refuse_len("tojson indent", len(indent))
        encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                   sort_keys=sort_keys)
        parts = []
        total = 0
        for chunk in encoder.iterencode(value):
            total += len(chunk)
            self._refuse_len("tojson result", total)
            parts.append(chunk)
        return "".join(parts)

    def _indent(self, s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> str:
        s = self._to_str(s, "indent input")
        pad = len(width) if isinstance(width, str) else self._int(width, "indent width")
        self._refuse_len("indent result", len(s) + (s.count("\n") + 1) * pad)
        return jinja2.filters.do_indent(s, width, first, blank)

    def _format_filter(self, value: Any, *args: Any, **kwargs: Any) -> str:
        fmt = self._to_str(value, "format input")
        self._check_printf(fmt, kwargs or args)
        return jinja2.filters.do_format(fmt, *args, **kwargs)

    def _replace_filter(self, eval_ctx: Any, s: Any, old: Any, new: Any, count: Any = None) -> str:
        s = self._to_str(s, "replace input")
        self._precheck_str_method(s, "replace", (str(old), str(new), -1 if count is None else count), {})
        return jinja2.filters.do_replace(eval_ctx, s, old, new, count)

    _replace_filter.jinja_pass_arg = jinja2.utils._PassArg.eval_context  # type: ignore[attr-defined]

    def _join_filter(self, eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
        value = self._materialize(value)
        if attribute is None and isinstance(d, str):
            self._join_estimate(d, value)
        return jinja2.filters.sync_do_join(eval_ctx, value, d, attribute)

    _join_filter.jinja_pass_arg = jinja2.utils._PassArg.eval_context  # type: ignore[attr-defined]

    def _wordwrap(self, environment: Any, s: str, width: int = 79, break_long_words: bool = True,
                  wrapstring: Any = None, break_on_hyphens: bool = True) -> str:
        s = self._to_str(s, "wordwrap input")
        self._int(width, "wordwrap width")
        sep = wrapstring if isinstance(wrapstring, str) else "\n"
        self._refuse_len("wordwrap result", len(s) * (1 + len(sep)))
        return jinja2.filters.do_wordwrap(environment, s, width, break_long_words, wrapstring, break_on_hyphens)

    _wordwrap.jinja_pass_arg = jinja2.utils._PassArg.environment  # type: ignore[attr-defined]

    def _sum_filter(self, environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
        iterable = self._materialize(iterable)
        if isinstance(start, (list, tuple, str)) and isinstance(iterable, (list, tuple)):
            total = len(start)
            for item in iterable:
                total += len(item) if isinstance(item, (list, tuple, str)) else 0
                self._refuse_len("sum() result", total)
        return jinja2.filters.sync_do_sum(environment, iterable, attribute, start)

    _sum_filter.jinja_pass_arg = jinja2.utils._PassArg.environment  # type: ignore[attr-defined]

    def _string_filter(self, value: Any) -> str:
        return jinja2.filters.soft_str(value) if isinstance(value, str) else self._to_str(value, "string filter")


def _counted(value: Any) -> Iterable:
    for item in value:
        _step()
        yield item


def _raise_exception(message: Any) -> None:
    raise _TemplateRaise(str(message))


class _TemplateRaise(Exception):
    pass


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > 256:
        raise _Refused("strftime_now() format must be a string of at most 256 characters")
    return datetime.now().strftime(fmt)


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """A private copy of caller data made only of JSON types (what HF hands templates)."""
    if depth > 64:
        raise ChatMessageError(f"{where}: nested more than 64 levels deep")
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ChatMessageError(f"{where}: keys must be strings, got {type(k).__name__}")
            out[str.__str__(k)] = _plain(v, f"{where}.{k}", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    raise ChatMessageError(f"{where}: unsupported value of type {type(value).__name__}")


def validate_messages(messages: Any) -> list[dict]:
    """Check roles and content types; return a plain copy (None-valued keys dropped, as HF does)."""
    if not isinstance(messages, (list, tuple)):
        raise ChatMessageError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatMessageError(f"message {i}: must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ChatMessageError(f"message {i}: role must be one of {', '.join(ROLES)}, got {role!r}")
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                    raise ChatMessageError(f"message {i}: content part {j} must be a dict with a string 'type'")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise ChatMessageError(f"message {i}: text content part {j} needs a string 'text'")
        elif content is not None and not isinstance(content, str):
            raise ChatMessageError(
                f"message {i}: content must be a string or a list of content parts, got {type(content).__name__}")
        if content is None and role != "assistant":
            raise ChatMessageError(f"message {i}: a {role} message needs content")
        plain = _plain({k: v for k, v in message.items() if v is not None}, f"message {i}")
        reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:  # HF aliases the reasoning under the names templates read
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


def think_prefix(rendered: str, start: str = "<think>", end: str = "</think>") -> bool:
    """True when the rendered prompt leaves a reasoning block open (ends with ``<think>``, whitespace aside)."""
    return rendered.rstrip().endswith(start)


class ChatTemplate:
    """A model's chat template, compiled once, rendered in a bounded sandbox."""

    def __init__(
        self,
        source: str | None,
        bos_token: str = "",
        eos_token: str = "",
        name: str = "<model>",
        *,
        max_output: int = 1 << 20,
        max_steps: int = 1_000_000,
        timeout_s: float = 5.0,
        max_range: int = 100_000,
        max_int_bits: int = 4096,
        max_source: int = 1 << 20,
    ) -> None:
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.builtin = source is None
        self.source = CHATML_TEMPLATE if source is None else source
        self.max_output = max_output
        self.max_steps = max_steps
        self.timeout_s = timeout_s
        if not isinstance(self.source, str):
            raise TemplateError(f"chat template of {name}: must be text, got {type(self.source).__name__}")
        if len(self.source) > max_source:
            raise TemplateLimitError(
                f"chat template of {name}: {len(self.source):,} characters long (limit {max_source:,})")
        self._env = _BoundedEnvironment(max_len=max_output, max_int_bits=max_int_bits, max_range=max_range)
        try:
            self._template = self._env.from_string(self.source)
        except TemplateSyntaxError as exc:
            raise TemplateError(f"chat template of {name}: syntax error at line {exc.lineno}: {exc.message}") from None
        except (RecursionError, MemoryError):
            raise TemplateLimitError(f"chat template of {name}: too deeply nested to compile") from None
        except _Refused as exc:
            raise exc.kind(f"chat template of {name}: refused {exc}") from None
        except Exception as exc:  # noqa: BLE001 - anything else the compiler raises on hostile input
            raise TemplateError(f"chat template of {name}: cannot compile: {type(exc).__name__}: {exc}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self.name!r}, builtin={self.builtin})"

    def render(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: Any = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text.

        ``enable_thinking`` is passed to the template only when not None (Qwen's
        template tests ``enable_thinking is defined``). Extra keyword arguments
        become template variables (plain JSON data only).
        """
        msgs = validate_messages(messages)
        if tools is not None:
            if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
                raise ChatMessageError("tools must be a list of dicts (JSON schemas)")
            tools = _plain(tools, "tools")
        context: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        context.update(_plain(kwargs, "template argument"))
        if enable_thinking is not None:
            context["enable_thinking"] = bool(enable_thinking)
        context.update(messages=msgs, tools=tools, documents=None, add_generation_prompt=bool(add_generation_prompt))

        budget = _Budget(self.max_steps, 64 * self.max_output, 16 * self.max_output, self.timeout_s)
        token = _BUDGET.set(budget)
        what = f"chat template of {self.name}"
        try:
            parts = []
            total = 0
            for chunk in self._template.generate(**context):
                total += len(chunk)
                if total > self.max_output:
                    raise _Refused(f"output longer than {self.max_output:,} characters")
                parts.append(chunk)
            return "".join(parts)
        except _Refused as exc:
            raise exc.kind(f"{what}: refused: {exc}") from None
        except _TemplateRaise as exc:
            raise TemplateRaisedError(f"{what} rejected the conversation: {exc}") from None
        except SecurityError as exc:
            raise TemplateSecurityError(f"{what}: sandbox violation: {exc}") from None
        except UndefinedError as exc:
            raise TemplateError(f"{what}: {exc}") from None
        except RecursionError:
            raise TemplateLimitError(f"{what}: refused: recursion too deep") from None
        except MemoryError:
            raise TemplateLimitError(f"{what}: refused: out of memory") from None
        except jinja2.TemplateError as exc:
            raise TemplateError(f"{what}: {type(exc).__name__}: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
                ArithmeticError, LookupError) as exc:
            raise TemplateError(f"{what}: render failed: {type(exc).__name__}: {exc}") from None
        finally:
            _BUDGET.reset(token)

    def think_prefix(self, rendered: str) -> bool:
        """Whether ``rendered`` leaves a ``<think>`` block open for the model to continue."""
        return think_prefix(rendered)

    def think_open(self, prompt_text: str | None = None, enable_thinking: bool | None = None) -> bool:
        """Whether generation starts inside a reasoning block.

        With ``prompt_text`` (the rendered prompt) this is :meth:`think_prefix`; without it,
        a one-message probe conversation is rendered with ``enable_thinking`` (cached per
        value); a template that refuses the probe counts as not thinking.
        """
        if prompt_text is not None:
            return think_prefix(prompt_text)
        key = None if enable_thinking is None else bool(enable_thinking)
        cache = self.__dict__.setdefault("_think_open_cache", {})
        if key not in cache:
            try:
                probe = self.render([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                    enable_thinking=key)
                cache[key] = think_prefix(probe)
            except PagelmError:
                cache[key] = False
        return cache[key]
