"""Helper processes that die: the one error that names them, and how a process ended, in words (stdlib only).

Loader workers, checkpoint writers, the converter's ranks and the offline job's workers raise
`ProcessDiedError` when one of their processes is gone, so every entry point reports it as one line.
"""

from __future__ import annotations

import signal

from mmpack.packing.errors import MmpackError


class ProcessDiedError(MmpackError, RuntimeError):
    """A process this job waits for died before it delivered its result; the message names it and how."""

    default_reason = "process_died"


def describe_exit(exitcode: int | None) -> str:
    """How a process ended from its `multiprocessing` exit code: "was killed by SIGKILL" for -9,
    "exited with code 1" for 1, "is still running" for None."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        return f"was killed by {_signal_name(-exitcode)}"
    return f"exited with code {exitcode}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
