"""An exclusive flock on a lock file, shared correctly by threads and processes."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


@contextlib.contextmanager
def flock(path: str, *, blocking: bool = True, create: bool = True) -> Iterator[bool]:
    """Holds an exclusive flock on `path` (created unless `create=False`: an existing file, opened read-only,
    such as the data file itself, which spares creating a lock file)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644) if create else os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
