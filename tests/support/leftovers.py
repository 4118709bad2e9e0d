"""No process a test run starts outlives it: the pytest process adopts its orphans, and what still runs at the
end of the run is named, failed and stopped (``tests/conftest.py``'s session-finish hook).

The pytest process is made a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): a process whose parent dies
(a loader worker of a rank killed by a test) is re-parented to it, not to init, so its descendants at the end
of the run are everything the run started that still runs. Processes ended but not yet waited for (zombies) do
not count. The run's own helpers that end with it are left out: the warm fork server of
``tests/support/ranks.py`` (its pid, recorded when it starts) and ``multiprocessing``'s resource tracker.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time
from collections.abc import Iterable

import psutil

PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 20.0  # for processes that are ending (a helper waits up to a second to see its parent gone)


def become_subreaper() -> bool:
    """Makes this process the reaper of its orphaned descendants (Linux); False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0


def running_descendants(keep: Iterable[int] = ()) -> list[psutil.Process]:
    """This process's descendants that still run, but those in ``keep`` (pids) and ``multiprocessing``'s
    resource trackers started by this process (they end with it)."""
    keep = set(keep)
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.pid in keep or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.ppid() == os.getpid() and "multiprocessing.resource_tracker" in " ".join(proc.cmdline()):
                continue
        except psutil.Error:  # ended meanwhile
            continue
        found.append(proc)
    return found


def leftover_processes(keep: Iterable[int] = (), grace_s: float = GRACE_S) -> list[psutil.Process]:
    """:func:`running_descendants`, once those ending have had ``grace_s`` seconds to end."""
    keep = set(keep)
    deadline = time.monotonic() + grace_s
    left = running_descendants(keep)
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = running_descendants(keep)
    return left


def describe(proc: psutil.Process) -> str:
    """``pid <pid> (parent <ppid>, <MB> MB): <command line>``, for the report."""
    try:
        rss_mb = proc.memory_info().rss >> 20
        return f"pid {proc.pid} (parent {proc.ppid()}, {rss_mb} MB): {' '.join(proc.cmdline())[:300]}"
    except psutil.Error:
        return f"pid {proc.pid} (ended while being described)"


def stop(procs: Iterable[psutil.Process]) -> None:
    """SIGKILL to each (the report is made: nothing is left behind for the next run)."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def job_processes(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants now (a job's, recorded before something is killed)."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                found[p.pid] = p
        except psutil.Error:  # already gone
            continue
    return list(found.values())


def _runs(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def still_running(procs: Iterable[psutil.Process], within_s: float) -> list[psutil.Process]:
    """Those of ``procs`` that still run after up to ``within_s`` seconds (none: returns as soon as all ended;
    a zombie has ended). ``is_running`` compares start times, so a reused pid is not taken for the process."""
    procs = list(procs)
    deadline = time.monotonic() + max(0.0, within_s)
    left = [p for p in procs if _runs(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if _runs(p)]
    return left
