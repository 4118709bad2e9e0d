"""Errors of the packing job, the rows of rejects.jsonl, and the one line a failed `mmpack` command prints.

Every error mmpack raises on purpose is a `mmpack.packing.errors.MmpackError` with a `reason`; per-sample ones become
reject rows, job-level ones end the command with `mmpack <cmd>: error: ...` (see `describe_failure`).
"""

from __future__ import annotations

import errno
import os
import re

from mmpack.packing.errors import MmpackError

_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.tmp-[0-9-]+$")  # atomic writes go through ".<name>.tmp-<pid>..."


class PackError(MmpackError, RuntimeError):
    """The job cannot go on (bad option, `--strict` reject, `--overlength error`); the message says why."""

    default_reason = "job_error"


class SampleReject(MmpackError):
    """A per-sample problem: the sample goes to rejects.jsonl with `reason` (short snake_case)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message, reason=reason)


def reject_row(
    source: str, line: int, reason: str, message: str, stage: str, sample_id: str | None = None
) -> dict:
    """One line of rejects.jsonl."""
    row: dict = {"source": source, "line": line, "reason": reason, "message": message, "stage": stage}
    if sample_id is not None:
        row["sample_id"] = sample_id
    return row


_OS_ADVICE = {
    errno.ENOSPC: "no space left on the device; free space or choose another output (-o) / --work-dir",
    errno.EDQUOT: "disk quota exceeded; free space or choose another output (-o) / --work-dir",
    errno.EACCES: "permission denied; choose a folder you can write to (-o, --work-dir) or fix its permissions",
    errno.EPERM: "operation not permitted; choose a folder you can write to (-o, --work-dir)",
    errno.EROFS: "read-only file system; choose a writable output (-o) / --work-dir",
    errno.ENOENT: "no such file or folder; check the path",
    errno.EISDIR: "is a folder, a file was expected; check the path",
    errno.ENOTDIR: "a part of the path is not a folder; check the path",
}


def describe_failure(exc: BaseException) -> str:
    """The text after `mmpack <cmd>: error: ` for `exc`: what failed, on which file, and what to do."""
    if isinstance(exc, MmpackError):
        return exc.message
    if isinstance(exc, OSError):
        where = _final_name(str(exc.filename)) if exc.filename is not None else None
        advice = _OS_ADVICE.get(exc.errno or 0, exc.strerror or str(exc))
        if where is None:
            return f"{advice} ({exc})" if exc.errno in _OS_ADVICE else str(exc)
        return f"{where}: {advice}"
    if isinstance(exc, ValueError):
        return str(exc)
    return f"unexpected {type(exc).__name__}: {exc} (rerun with --debug for the traceback, and report it)"


def _final_name(path: str) -> str:
    """The file a temporary name stands for (what the user knows), else `path`."""
    head, tail = os.path.split(path)
    match = _TEMPORARY.match(tail)
    return os.path.join(head, match["name"]) if match else path
