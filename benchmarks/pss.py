"""Peak PSS of a process tree, sampled from /proc (Linux): what the benchmarks report as memory."""

from __future__ import annotations

import os
import threading


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _descendants(pid: int) -> list[int]:
    todo, seen = _children(pid), []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _pss_kb(pid: int) -> tuple[int, int]:
    """PSS of a process, and its anonymous and shared-memory part (what is left out, the PSS of mapped files
    such as libraries, moves with the other processes of the machine that map them too)."""
    fields = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss"):
                    name, value = line.split(":")
                    fields[name] = int(value.split()[0])
    except OSError:
        pass
    return fields.get("Pss", 0), fields.get("Pss_Anon", 0) + fields.get("Pss_Shmem", 0)


class PeakPss:
    """Peak of the PSS summed over this process (unless `include_self` is False) and the processes it starts
    while the block runs (servers started before, such as the S3 server, are left out), sampled every
    `interval_s` by a thread."""

    def __init__(self, interval_s: float = 0.05, include_self: bool = True) -> None:
        self.interval_s, self.peak_kb, self.peak_anon_shmem_kb = interval_s, 0, 0
        self.include_self = include_self
        self._stop = threading.Event()
        self._before: set[int] = set()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pss-sampler")

    def sample(self) -> int:
        me = os.getpid()
        pids = [me] * self.include_self + [p for p in _descendants(me) if p not in self._before]
        each = [_pss_kb(p) for p in pids]
        total = sum(pss for pss, _ in each)
        self.peak_kb = max(self.peak_kb, total)
        self.peak_anon_shmem_kb = max(self.peak_anon_shmem_kb, sum(part for _, part in each))
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> PeakPss:
        self._before = set(_descendants(os.getpid()))
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
