"""Child processes for tests that run real torch.distributed ranks.

Ranks are forked from a fork server started from a fresh interpreter, never from the pytest process itself: a
pytest process that once set up gloo groups in-process (megatron-core's parallel state on one rank, as the tower
and export tests do) leaves gloo state behind that a forked child inherits half-alive; such children crash
(SIGSEGV) or hang when they set up their own groups.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess


def fresh_process_context(*preload: str) -> multiprocessing.context.BaseContext:
    """The fork-server context; ``preload`` (module names) is imported once in the server, so that each rank
    starts without importing torch and megatron-core again. The first call in a process sets the preload."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def join_or_kill(procs: Sequence[BaseProcess], timeout_s: float) -> None:
    """Wait for every process within one shared deadline; kill those still running after it (their exit
    codes then read negative, so the caller's assertion names them)."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()
