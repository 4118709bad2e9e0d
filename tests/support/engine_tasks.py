"""Chunk functions for the engine tests, importable by Ray workers (they pickle by reference): one whose
first call SIGKILLs its own worker process, once (a marker file records that it did), so a test can show that
Ray's retry leaves the output unchanged; one that tells which caches a chunk ran with; one that fails on
chosen items."""

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


def caches_seen(ctx: Any, task: Any) -> tuple[int, int, str]:
    """(worker pid, id of the context's caches, the node the context is on) of the chunk's process."""
    ctx.caches.get("seen", None, lambda: task)  # something kept, as a stage keeps its tokenizer
    return os.getpid(), id(ctx.caches), ctx.node


def fail_on(ctx: Any, task: tuple[int, set[int]]) -> int:
    """`task[0]` squared, or ValueError naming it when it is in `task[1]`; exits the process on -1."""
    i, bad = task
    if i == -1:
        os._exit(3)
    if i in bad:
        raise ValueError(f"item {i} is bad")
    return i * i
