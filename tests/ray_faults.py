"""Fault injection for the Ray engine's tests: a chunk function whose first call SIGKILLs its own worker
process, once (a marker file records that it did), so a test can show that Ray's retry leaves the output
unchanged. Importable by the Ray workers (the functions pickle by reference)."""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable
from typing import Any


def killing_once(marker: str, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """`fn(ctx, task)`, except that the first call anywhere (no `marker` file yet) writes `marker` and kills its
    process instead."""
    return functools.partial(_kill_once_then, marker, fn)


def _kill_once_then(marker: str, fn: Callable[[Any, Any], Any], ctx: Any, task: Any) -> Any:
    if not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(f"killed worker pid {os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    return fn(ctx, task)
