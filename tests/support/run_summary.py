"""The closing lines of every pytest run (tests/conftest.py's ``pytest_terminal_summary``): how many tests were
skipped and why, grouped by reason, and the suite's time by marker (the tiers docs/testing.md names)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from tests.support.shared import SHARED_REASON

# the markers a run's time is reported by (pyproject.toml declares them); "unmarked": none of them
TIERS = ("ranks", "family", "shared", "gpu", "slow")


def skip_reason(report: Any) -> str:
    """The reason of a skipped test or collection report (``Skipped: `` taken off)."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ").strip()


def skip_group(reason: str) -> str:
    """The group of a skip reason: every ../shared skip is one group; otherwise the reason up to its first
    colon or parenthesis (``needs the energon extra (megatron.energon: ...)`` -> ``needs the energon extra``)."""
    if reason.startswith(SHARED_REASON):
        return SHARED_REASON
    return re.split(r":| \(", reason, maxsplit=1)[0].strip() or "no reason given"


def skip_line(reasons: Iterable[str]) -> str:
    """``skipped: 12 (needs ../shared: 10, needs CUDA: 2)``; ``skipped: 0`` when nothing was skipped."""
    groups = Counter(skip_group(r) for r in reasons)
    total = sum(groups.values())
    if not total:
        return "skipped: 0"
    parts = ", ".join(f"{group}: {n}" for group, n in sorted(groups.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"skipped: {total} ({parts})"


def marker_time_line(durations: Mapping[str, float], tiers: Mapping[str, Iterable[str]]) -> str:
    """``time by marker: ranks 512 s (88 tests), ..., unmarked 140 s (700 tests); all 900 s (820 tests)``:
    the summed setup + call + teardown seconds of the tests that ran, under each of their markers (a test
    marked ``ranks`` and ``slow`` counts under both); ``unmarked``: none of ``TIERS``."""
    seconds: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for nodeid, secs in durations.items():
        marks = [m for m in TIERS if m in set(tiers.get(nodeid, ()))] or ["unmarked"]
        for mark in marks:
            seconds[mark] += secs
            count[mark] += 1
    parts = [f"{m} {seconds[m]:.0f} s ({_tests(count[m])})" for m in (*TIERS, "unmarked") if count[m]]
    total = sum(durations.values())
    return (
        f"time by marker: {', '.join(parts) or 'no test ran'}; all {total:.0f} s ({_tests(len(durations))})"
    )


def file_time_line(durations: Mapping[str, float], top: int = 12) -> str:
    """``time by file (top 12): test_a.py 120 s (8), test_b.py 90 s (3), ...``: the summed seconds of each test
    file's tests, the costliest first, so that a run's log says where its time went."""
    seconds: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for nodeid, secs in durations.items():
        name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        seconds[name] += secs
        count[name] += 1
    parts = [f"{name} {secs:.0f} s ({count[name]})" for name, secs in seconds.most_common(top)]
    return f"time by file (top {top}): {', '.join(parts) or 'no test ran'}"


def _tests(n: int) -> str:
    return f"{n} test" if n == 1 else f"{n} tests"


def durations_of(reports: Iterable[Any]) -> dict[str, float]:
    """Seconds per test id: its setup, call and teardown reports summed (collection reports left out)."""
    out: dict[str, float] = {}
    for rep in reports:
        if getattr(rep, "when", None) in ("setup", "call", "teardown"):
            out[rep.nodeid] = out.get(rep.nodeid, 0.0) + float(rep.duration)
    return out
