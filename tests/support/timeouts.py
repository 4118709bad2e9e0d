"""A deadline for a block of test code that could hang (a blocking open() of a FIFO, a job that never ends)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fails the test instead of hanging it: SIGALRM interrupts even a blocking open() of a FIFO."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s: the job hangs")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
