"""The base of mmpack's own errors: every one carries a short snake_case `reason` and a `message` for people.

Code that turns an error into a reject row or a CLI line reads `exc.reason` and `exc.message` of an
`MmpackError`; nothing guesses among attribute names.
"""

from __future__ import annotations

from typing import Any


class MmpackError(Exception):
    """An error mmpack raises on purpose; `reason` names its kind (rejects.jsonl, CLI), `message` says why."""

    default_reason = "error"

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason

    def __reduce__(self) -> tuple[Any, ...]:
        # subclasses take other constructor arguments: rebuild from the fields, so the error crosses processes
        return (_rebuild, (type(self), self.message, self.reason))


def _rebuild(cls: type[MmpackError], message: str, reason: str) -> MmpackError:
    exc = cls.__new__(cls)
    MmpackError.__init__(exc, message, reason=reason)
    return exc
