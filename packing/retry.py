"""Retrying a storage call, only on errors a retry can cure: the one retry rule of mmpack.

`retry_call(fn, policy)` runs `fn()` and, while it raises a transient error (`is_transient`: a dropped or
reset connection, a timeout, a cut-off body, a server's 5xx or throttling answer), waits with exponential
backoff and jitter and tries again; once `policy.max_attempts` are spent it raises `RetriesExhausted`
(the last error as its cause). Any other error (a missing object, no permission, a bad request, a bug)
is raised at once, as it is: retrying would only delay the same answer.
"""

from __future__ import annotations

import errno
import http.client
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
# errno values of OSErrors that a retry can cure (s3fs maps 5xx and throttling answers to EBUSY, EREMOTEIO
# and, for codes it does not know, EIO).
TRANSIENT_ERRNOS = frozenset(
    {errno.EIO, errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED}
    | {errno.ECONNREFUSED, errno.EPIPE, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EREMOTEIO}
)
# Errors that never pass on retrying, whatever caused them.
PERMANENT = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)
TRANSIENT_HTTP_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
# botocore ClientError codes of throttling and server trouble
TRANSIENT_S3_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed"}
    | {"InternalError", "ServiceUnavailable", "OperationAborted", "500", "502", "503", "504"}
)


@dataclass(kw_only=True, frozen=True)
class RetryPolicy:
    """How often and how patiently a call is retried."""

    max_attempts: int = 5
    backoff_s: float = 0.2  # wait before the first retry (doubling after each)
    max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff_s and max_backoff_s must be >= 0")

    def delay_s(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1, 2, ...): doubling, capped, with jitter."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (retry - 1)) * (0.5 + random.random())


class RetriesExhausted(OSError):
    """Every attempt failed with a transient error; `last` is the last one (also the cause)."""

    def __init__(self, attempts: int, last: BaseException):
        super().__init__(f"{attempts} attempts failed; last error {type(last).__name__}: {last}")
        self.attempts = attempts
        self.last = last


def is_transient(exc: BaseException) -> bool:
    """True for an error a retry can cure (see the module docstring), looking through its causes (and the
    errors it was raised while handling)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, PERMANENT):
            return False
        if _transient_here(current):
            return True
        seen.add(id(current))
        hidden = current.__suppress_context__  # `raise ... from None`: what it replaced is not its cause
        current = current.__cause__ or (None if hidden else current.__context__)
    return False


def _transient_here(exc: BaseException) -> bool:
    if isinstance(exc, (TimeoutError, ConnectionError, http.client.IncompleteRead)):
        return True
    if isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS:
        return True
    module = type(exc).__module__.split(".")[0]
    if module == "aiohttp":
        import aiohttp

        if isinstance(exc, aiohttp.ClientResponseError):
            return exc.status in TRANSIENT_HTTP_STATUS
        return isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))
    if module in ("botocore", "urllib3"):
        return _transient_botocore(exc)
    if module == "fsspec":
        from fsspec.exceptions import FSTimeoutError

        return isinstance(exc, FSTimeoutError)
    return False


def _transient_botocore(exc: BaseException) -> bool:
    try:
        from botocore import exceptions as bx
        from botocore.parsers import ResponseParserError
    except ImportError:  # a urllib3 error without botocore: its connection errors are transient
        return "Timeout" in type(exc).__name__ or "Connection" in type(exc).__name__
    if isinstance(exc, bx.ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return error.get("Code") in TRANSIENT_S3_CODES or status in TRANSIENT_HTTP_STATUS
    # a body cut or changed in transit (botocore checks its checksum) comes right on a new read
    transient: tuple[type[BaseException], ...] = (
        bx.HTTPClientError,
        bx.ConnectionError,
        bx.IncompleteReadError,
    )
    transient += (bx.ResponseStreamingError, bx.ChecksumError, bx.FlexibleChecksumError, ResponseParserError)
    return isinstance(exc, transient)


def retry_call(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    transient: Callable[[BaseException], bool] = is_transient,
    on_retry: Callable[[int, BaseException], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`fn()`, retried under `policy` while it raises an error `transient` accepts.

    `on_retry(retry, error)` is called before each wait (retry = 1, 2, ...); `sleep` waits (a caller that
    can be cancelled passes one that raises).

    Raises:
        RetriesExhausted: every attempt failed with a transient error.
        Exception: the first error that is not transient, unchanged.
    """
    for attempt in range(1, policy.max_attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if not transient(exc):
                raise
            if attempt == policy.max_attempts:
                raise RetriesExhausted(attempt, exc) from exc
            if on_retry is not None:
                on_retry(attempt, exc)
            sleep(policy.delay_s(attempt))
    raise AssertionError("unreachable: max_attempts >= 1")
