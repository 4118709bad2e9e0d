"""`BoundedEnvironment`: jinja2's immutable sandbox that renders a chat template under `TemplateLimits`.

`compile_bounded` adds the loop and output checks to a template's syntax tree: each `{% for %}` iterates through
a timed filter, each piece of output and each `~` / `{% set %}` value goes through a counting one. A template
cannot redefine a filter, so it cannot step round them. The sandbox's own hooks (`call`, `call_binop`, the
filters, `range`) check the rest (`mmpack.packing.template_limits` says what each limit covers).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from jinja2 import nodes, pass_context
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from mmpack.packing.template_limits import ChatTemplateLimitError, RenderBudget, TemplateLimits

MAX_RANGE = 100_000  # jinja2's own sandbox limit on range()
# the filters the instrumented tree calls: a template may call them too, but cannot redefine them
_LOOP, _SIZED, _WRITTEN = "mmpack_loop", "mmpack_sized", "mmpack_written"


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with the render limits of `TemplateLimits` (see the module docstring).

    Render only inside `rendering(input_chars)`, which holds the render's budget (one per thread).
    """

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, limits: TemplateLimits, **options: Any) -> None:
        super().__init__(**options)
        self.limits = limits
        self._local = threading.local()
        self.globals["range"] = self._range
        self.globals.pop("lipsum", None)  # writes text by the paragraph count it is given: no use in a chat
        self.filters[_LOOP] = pass_context(lambda _ctx, items: self._loop(items))
        self.filters[_SIZED] = pass_context(lambda _ctx, value: self.budget().check_value(value))
        self.filters[_WRITTEN] = pass_context(lambda _ctx, value: self.budget().write(value))
        self._wrapped: set[str] = {_LOOP, _SIZED, _WRITTEN}

    @contextmanager
    def rendering(self, input_chars: int) -> Iterator[RenderBudget]:
        """A fresh budget for one render of a conversation of `input_chars` characters."""
        self._local.budget = RenderBudget(self.limits, input_chars)
        try:
            yield self._local.budget
        finally:
            self._local.budget = None

    def budget(self) -> RenderBudget:
        found = getattr(self._local, "budget", None)
        if found is None:  # compile time (constant folding) or a render outside `rendering`
            raise ChatTemplateLimitError("was evaluated outside a bounded render")
        return found

    def compile_bounded(self, source: str) -> Any:
        """The template of `source` with the loop and output checks added (see the module docstring)."""
        if len(source) > self.limits.max_source_chars:
            raise ChatTemplateLimitError(
                f"is {len(source)} characters long, above the limit of {self.limits.max_source_chars}"
            )
        self._wrap_filters()
        tree = _Instrument().visit(self.parse(source))
        tree.set_environment(self)
        return self.from_string(tree)

    def _wrap_filters(self) -> None:
        for name in set(self.filters) - self._wrapped:
            self.filters[name] = self._bounded_filter(name, self.filters[name])
            self._wrapped.add(name)

    def _bounded_filter(self, name: str, fn: Any) -> Any:
        # the filter's own first argument (jinja2 marks it on the function: context, eval_context, environment)
        kind = getattr(getattr(fn, "jinja_pass_arg", None), "name", None)

        @pass_context
        def bounded(context: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            budget = self.budget()
            budget.tick()
            budget.before_call(name, value, args, kwargs, is_filter=True)
            first = {"context": (context,), "eval_context": (context.eval_ctx,), "environment": (self,)}
            return budget.check_value(fn(*first.get(kind or "", ()), value, *args, **kwargs))

        return bounded

    def _loop(self, iterable: Any) -> Iterator[Any]:
        budget = self.budget()
        for item in iterable:
            budget.tick()
            yield item

    def _range(self, *args: int) -> range:
        items = range(*args)
        try:
            too_long = len(items) > MAX_RANGE
        except OverflowError:  # more items than an index can count
            too_long = True
        if too_long:
            raise ChatTemplateLimitError(f"asks for a range of more than {MAX_RANGE} items (the limit)")
        return items

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = self.budget()
        budget.tick()
        budget.check_binop(operator, left, right)
        return budget.check_value(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = __self.budget()
        budget.tick()
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        subject = getattr(method, "__self__", None)
        if isinstance(subject, str):
            given = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
            budget.before_call(getattr(method, "__name__", ""), subject, args, given, is_filter=False)
        if budget.depth >= budget.limits.max_depth:
            what = "a macro that calls itself without end?" if isinstance(__obj, Macro) else "calls in calls"
            raise ChatTemplateLimitError(f"nests calls deeper than {budget.limits.max_depth} ({what})")
        budget.depth += 1
        try:
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            budget.depth -= 1
        return budget.check_value(result)


class _Instrument(NodeTransformer):
    """Routes every loop's items through the timed filter, every piece of text written through the counting
    one, and every `~` and `{% set %}` value through the size check."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _filtered(node.iter, _LOOP)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        node.nodes = [_filtered(child, _WRITTEN) for child in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _filtered(node, _SIZED)

    def visit_Assign(self, node: nodes.Assign) -> nodes.Node:
        self.generic_visit(node)
        node.node = _filtered(node.node, _SIZED)
        return node


def _filtered(node: nodes.Node, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)
