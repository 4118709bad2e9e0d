"""The one retry rule (`mmpack.packing.retry`): transient storage errors are retried with backoff, every other
error is raised at once, and the attempts are bounded."""

from __future__ import annotations

import errno

import pytest

from mmpack.packing.retry import RetriesExhausted, RetryPolicy, is_transient, retry_call

FAST = RetryPolicy(max_attempts=4, backoff_s=0.0)


def _aiohttp_errors() -> tuple[list[BaseException], list[BaseException]]:
    import aiohttp
    from yarl import URL

    info = aiohttp.RequestInfo(URL("http://x/y"), "GET", {}, URL("http://x/y"))  # type: ignore[arg-type]

    def status(code: int) -> aiohttp.ClientResponseError:
        return aiohttp.ClientResponseError(info, (), status=code)

    transient = [
        aiohttp.ClientPayloadError("cut"),
        aiohttp.ServerDisconnectedError(),
        status(503),
        status(429),
    ]
    return transient, [status(403), status(400)]


def _botocore_errors() -> tuple[list[BaseException], list[BaseException]]:
    from botocore.exceptions import ClientError, EndpointConnectionError

    def code(name: str, http: int) -> ClientError:
        return ClientError(
            {"Error": {"Code": name}, "ResponseMetadata": {"HTTPStatusCode": http}}, "GetObject"
        )

    slow = OSError(errno.EBUSY, "SlowDown")  # as s3fs translates it
    slow.__cause__ = code("SlowDown", 503)
    denied = PermissionError("Access Denied")
    denied.__cause__ = code("AccessDenied", 403)
    return [EndpointConnectionError(endpoint_url="http://x"), code("InternalError", 500), slow], [denied]


def test_transient_errors_are_told_from_the_others() -> None:
    a_ok, a_bad = _aiohttp_errors()
    b_ok, b_bad = _botocore_errors()
    transient = [ConnectionResetError(), TimeoutError(), OSError(errno.ECONNRESET, "reset"), *a_ok, *b_ok]
    wrapped = RuntimeError("read failed")
    wrapped.__cause__ = ConnectionResetError()
    transient.append(wrapped)
    permanent = [FileNotFoundError("x"), PermissionError(), ValueError("bad"), OSError(errno.EINVAL, "bad")]
    permanent += [KeyError("k"), *a_bad, *b_bad]
    hidden = RuntimeError("replaced")
    hidden.__context__, hidden.__suppress_context__ = ConnectionResetError(), True  # `raise ... from None`
    permanent.append(hidden)
    assert [e for e in transient if not is_transient(e)] == []
    assert [e for e in permanent if is_transient(e)] == []


def test_retry_call_retries_only_transient_errors_and_gives_up() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    retried: list[int] = []
    assert retry_call(flaky, FAST, on_retry=lambda n, e: retried.append(n), sleep=lambda s: None) == "ok"
    assert len(calls) == 3 and retried == [1, 2]

    def always(exc: BaseException):
        def fn() -> None:
            calls.append(1)
            raise exc

        return fn

    calls.clear()
    with pytest.raises(RetriesExhausted) as info:
        retry_call(always(TimeoutError("slow")), FAST, sleep=lambda s: None)
    assert len(calls) == 4 and info.value.attempts == 4 and isinstance(info.value.last, TimeoutError)
    calls.clear()
    with pytest.raises(PermissionError):  # at once, unchanged
        retry_call(always(PermissionError("denied")), FAST, sleep=lambda s: None)
    assert len(calls) == 1


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = RetryPolicy(max_attempts=9, backoff_s=0.1, max_backoff_s=0.5)
    delays = [policy.delay_s(n) for n in range(1, 7)]
    assert all(0.05 <= d <= 0.15 for d in delays[:1]) and all(0.25 <= d <= 0.75 for d in delays[3:])
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
