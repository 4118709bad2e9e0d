"""Errors of the packing job and the rows of rejects.jsonl."""

from __future__ import annotations


class PackError(RuntimeError):
    """The job cannot go on (bad option, `--strict` reject, `--overlength error`); the message says why."""


class SampleReject(Exception):
    """A per-sample problem: the sample goes to rejects.jsonl with `reason` (short snake_case)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def reason_of(exc: BaseException) -> str | None:
    """The reason code of a `packing.chat.SampleError` (or any error carrying one), else None."""
    for attr in ("reason_code", "reason", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, str) and value:
            return value
    return None


def reject_row(
    source: str, line: int, reason: str, message: str, stage: str, sample_id: str | None = None
) -> dict:
    """One line of rejects.jsonl."""
    row: dict = {"source": source, "line": line, "reason": reason, "message": message, "stage": stage}
    if sample_id is not None:
        row["sample_id"] = sample_id
    return row
