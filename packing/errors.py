"""The base of mmpack's own errors: every one carries a short snake_case `reason` and a `message` for people.

Code that turns an error into a reject row or a CLI line reads `exc.reason` and `exc.message` of an
`MmpackError`; nothing guesses among attribute names.
"""

from __future__ import annotations


class MmpackError(Exception):
    """An error mmpack raises on purpose; `reason` names its kind (rejects.jsonl, CLI), `message` says why."""

    default_reason = "error"

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
