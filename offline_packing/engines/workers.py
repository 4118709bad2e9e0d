"""How many worker processes a job may start: the one cap every stage, engine and helper step goes through."""

from __future__ import annotations

import os


def machine_workers() -> int:
    """Processes this machine can run at once: the CPUs this process may use (its affinity mask, which a
    container's or scheduler's CPU limit narrows), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def capped_workers(requested: int, tasks: int | None = None) -> int:
    """The worker processes to start for `requested` (`-w`): at most one per CPU this machine gives the job
    (`machine_workers`) and one per task, at least 1. Every stage and the Energon metadata step start theirs
    through it, so `-w 99999` forks no more processes than the machine can run."""
    cap = min(max(1, requested), machine_workers())
    return cap if tasks is None else max(1, min(cap, tasks))
