"""Limits on rendering a model folder's chat template: time, text written, value sizes and call depth.

A model folder is input, and its chat template is code: it may loop for ever (nested `range(100000)`), allocate
without bound (`'x' * 4000000000`), recurse (a macro calling itself) or overflow (`range(10**12)`). Each render
gets a `RenderBudget` of `TemplateLimits`, which the sandbox's hooks (`mmpack.packing.bounded_jinja`) charge:

- time: every loop iteration, call, filter and operator checks the render's deadline, so a template that does
  not end stops in whatever process renders it (the driver, a local worker, a Ray worker): no signal, no thread;
- size: `*`, `**`, `+`, `%`, `range` and the filters and string methods that take a count (a width, an indent)
  are checked before they allocate, every result of a call, filter, `~` and `{% set %}` after; all the text the
  template writes (its output, and the bodies of macros and blocks) counts against the output limit;
- depth: calls (macros, recursive loops, caller blocks) nest at most `max_depth` deep.

A breach raises `ChatTemplateLimitError`; the renderer (`mmpack.packing.jinja_chat`) names the template file.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, fields
from typing import Any

from mmpack.packing.errors import MmpackError

# filters and string methods whose integer arguments are counts of characters or items they allocate
_COUNT_FILTERS = frozenset({"center", "indent", "truncate", "wordwrap", "batch", "slice", "tojson"})
_COUNT_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
_DIGITS = re.compile(r"\d+")
_PERCENT_FIELD = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d*))?")  # '%08.3f': width 08, precision 3
_BRACE_FIELD = re.compile(r"\{[^{}]*\}")
_NESTED_FIELD = re.compile(r"\{[^{}]*:[^{}]*\{")  # '{:>{w}}': a width given as an argument


@dataclass(frozen=True, kw_only=True)
class TemplateLimits:
    """What one render of a chat template may spend.

    The output limit of a render is `max_output_chars` plus `output_per_input_char` characters per character of
    the conversation's own text, so a long record renders where a runaway template stops.
    """

    timeout_s: float = 10.0
    max_output_chars: int = 16 << 20
    output_per_input_char: int = 4
    max_depth: int = 64  # nested calls: macros, recursive loops, caller blocks
    max_count: int = 1 << 20  # the largest width / indent / repeat count a filter or string method takes
    max_int_bits: int = 8192  # the largest integer a template computes
    max_source_chars: int = 1 << 20  # the template's own text

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"TemplateLimits.{f.name} must be > 0, got {getattr(self, f.name)!r}")

    def output_chars(self, input_chars: int) -> int:
        """The most characters a render of a conversation of `input_chars` characters may write."""
        return self.max_output_chars + self.output_per_input_char * input_chars


class ChatTemplateLimitError(MmpackError, ValueError):
    """A chat template went past a render limit (time, output, size, depth); the message says which."""

    default_reason = "chat_template_limit"


class RenderBudget:
    """The limits of one render and what it has spent so far."""

    def __init__(self, limits: TemplateLimits, input_chars: int) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s
        self.max_chars = limits.output_chars(input_chars)
        self.written = 0
        self.depth = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimitError(
                f"ran past the time limit of {self.limits.timeout_s:g} s (a loop that does not end?)"
            )

    def check_value(self, value: Any) -> Any:
        """`value`, refused where it is longer than the output limit or an integer above `max_int_bits`."""
        if isinstance(value, str | bytes | list | tuple | dict | set | frozenset):
            self.check_length(len(value))
        elif isinstance(value, int) and value.bit_length() > self.limits.max_int_bits:
            raise ChatTemplateLimitError(
                f"computes an integer of {value.bit_length()} bits, above the limit of {self.limits.max_int_bits}"
            )
        return value

    def check_length(self, n: int) -> None:
        if n > self.max_chars:
            raise ChatTemplateLimitError(
                f"builds a value of {n} characters or items, above the output limit of {self.max_chars}"
            )

    def check_count(self, n: Any) -> None:
        if isinstance(n, int) and abs(n) > self.limits.max_count:
            raise ChatTemplateLimitError(
                f"asks for a width, indent or count of {n}, above the limit of {self.limits.max_count}"
            )

    def write(self, value: Any) -> Any:
        """Count `value` as text the template writes (output, or a macro's or block's body)."""
        self.tick()
        self.written += len(value) if isinstance(value, str) else len(str(value))
        if self.written > 4 * self.max_chars:  # bodies may be written and dropped: some room over the output
            raise ChatTemplateLimitError(
                f"writes more than {4 * self.max_chars} characters (the output limit is {self.max_chars})"
            )
        return value

    def check_binop(self, op: str, left: Any, right: Any) -> None:
        """Refuse `left op right` before it allocates more than the limits allow."""
        sized = str | bytes | list | tuple
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, sized) and isinstance(n, int):
                    self.check_length(len(seq) * max(n, 0))
            if _both_int(left, right) and left.bit_length() + right.bit_length() > self.limits.max_int_bits:
                raise ChatTemplateLimitError(
                    f"multiplies integers past the limit of {self.limits.max_int_bits} bits"
                )
        elif op == "**" and _both_int(left, right) and abs(left) > 1 and right > 0:
            if right * left.bit_length() > self.limits.max_int_bits:
                raise ChatTemplateLimitError(
                    f"computes a power past the integer limit of {self.limits.max_int_bits} bits"
                )
        elif op == "+" and isinstance(left, sized) and isinstance(right, sized):
            self.check_length(len(left) + len(right))
        elif op == "%" and isinstance(left, str):
            self.check_percent_format(left, right if isinstance(right, tuple) else (right,))

    def check_percent_format(self, spec: str, args: tuple[Any, ...]) -> None:
        """The widths and precisions of a `%` format (and its `*` arguments) within `max_count`."""
        for match in _PERCENT_FIELD.finditer(spec):
            self.check_digits(match.group(1), match.group(2))
        if "*" in spec:
            for a in args:
                self.check_count(a)

    def check_brace_format(self, spec: str, args: tuple[Any, ...]) -> None:
        """The widths of a `str.format` string (and, where a width is itself a field, the arguments)."""
        for field_text in _BRACE_FIELD.findall(spec):
            self.check_digits(*_DIGITS.findall(field_text))
        if _NESTED_FIELD.search(spec):
            for a in args:
                self.check_count(a)

    def check_digits(self, *runs: str | None) -> None:
        for digits in runs:
            if digits and (len(digits) > 9 or int(digits) > self.limits.max_count):
                raise ChatTemplateLimitError(
                    f"formats with a width of {digits[:12]}, above the limit of {self.limits.max_count}"
                )

    def before_call(
        self, name: str, subject: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, is_filter: bool
    ) -> None:
        """Checks before a filter or a string method `name` runs on `subject`: its counts, and for the ones that
        multiply their input (indent, expandtabs, replace, join, format) an estimate of the result."""
        values = (*args, *kwargs.values())
        if name in (_COUNT_FILTERS if is_filter else _COUNT_METHODS):
            for a in values:
                self.check_count(a)
        if name == "join":  # the filter: items|join(sep); the method: sep.join(items)
            items, sep = (
                (subject, args[0] if args else kwargs.get("d", ""))
                if is_filter
                else (args[0] if args else (), subject)
            )
            if isinstance(items, str | list | tuple):
                self.check_length(_joined_length(items, sep))
        if not isinstance(subject, str) or not values:
            return
        first = values[0]
        if name == "indent" and isinstance(first, str | int):
            width = len(first) if isinstance(first, str) else max(first, 0)
            self.check_length(len(subject) + (subject.count("\n") + 1) * width)
        elif name == "expandtabs" and isinstance(first, int):
            self.check_length(len(subject) + subject.count("\t") * max(first, 0))
        elif name == "replace" and len(values) >= 2 and isinstance(first, str) and isinstance(values[1], str):
            hits = subject.count(first) if first else len(subject) + 1
            self.check_length(len(subject) + hits * max(len(values[1]) - len(first), 0))
        elif name == "format" and is_filter:  # value|format(...) is value % args
            self.check_percent_format(subject, tuple(values))
        elif name in ("format", "format_map"):
            self.check_brace_format(subject, tuple(values))


def _both_int(a: Any, b: Any) -> bool:
    return isinstance(a, int) and isinstance(b, int)


def _joined_length(items: str | list[Any] | tuple[Any, ...], sep: Any) -> int:
    parts = len(items) if isinstance(items, str) else sum(len(x) if isinstance(x, str) else 16 for x in items)
    return parts + (len(sep) if isinstance(sep, str) else 16) * max(len(items) - 1, 0)
