"""What a rank says when the job cannot go on because a process is gone: one line, not a traceback.

A helper process that died (loader worker, checkpoint writer) raises
:class:`~mmpack.packing.processes.ProcessDiedError`, which names it. A peer rank that died shows on the
others as a collective whose connection closed (gloo) or that timed out (``--distributed-timeout-minutes``,
gloo and NCCL alike); the rank that died is named by its own line or by the launcher (torchrun's report
gives its rank, pid and signal).
"""

from __future__ import annotations

import re

from mmpack.packing.processes import ProcessDiedError

_TIMED_OUT = re.compile(r"Timed out waiting|timed out|Watchdog caught collective operation timeout", re.I)
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Socket closed|"
    r"NCCL communicator was aborted|remote process exited or there was a network error",
    re.I,
)


def describe_failure(error: BaseException, *, timeout_minutes: float) -> str | None:
    """One line for a dead process, a collective that timed out or lost a peer; None for any other error."""
    if isinstance(error, ProcessDiedError):
        return error.message
    if not isinstance(error, RuntimeError):
        return None
    text = " ".join(str(error).split())[:400]
    if _TIMED_OUT.search(text):
        return (
            f"a collective did not complete within --distributed-timeout-minutes {timeout_minutes:g}: another "
            f"rank is stuck or gone ({text})"
        )
    if _PEER_GONE.search(text):
        return f"another rank is gone: a collective lost its connection ({text})"
    return None
