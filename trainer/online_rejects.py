"""The records of an online-packed run (--online-packing) that the loader skipped: counted for the log line and the
metrics at each step, and totalled at the run's end.

The loader of each DP replica walks the whole raw stream, so each one counts every reject of the buffers it has
passed (`raw_samples_read`, `raw_samples_rejected`, `raw_rejected.<reason>` in `PackedLoader.metrics`) and writes
them to `<folder>/rejects-dp<R>.jsonl`; the run's count is the largest over the ranks (the replica furthest on),
not their sum.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

READ = "raw_samples_read"
REJECTED = "raw_samples_rejected"
BY_REASON = "raw_rejected."  # the prefix of each reason's count


def _loader_counts(data: Any) -> dict[str, int]:
    """This rank's raw-source counters (none on a rank that reads no data)."""
    source = getattr(data, "source", None)
    if source is None:
        return {}
    return {k: int(v) for k, v in source.metrics().items() if k.startswith("raw_")}


class RawRejects:
    """Reject counts of a raw source over every rank; `folder`: where the loaders write their rejects files
    (None: nowhere, the counts only)."""

    def __init__(self, folder: str | None) -> None:
        self.folder = folder

    def step_metrics(self, data: Any) -> dict[str, int]:
        """`raw_rejected` and `raw_samples_read` so far (collective: every rank calls it at each step)."""
        mine = _loader_counts(data)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        t = torch.tensor([float(mine.get(REJECTED, 0)), float(mine.get(READ, 0))], dtype=torch.float64, device=device)  # fmt: skip
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return {"raw_rejected": int(t[0].item()), "raw_samples_read": int(t[1].item())}

    def totals(self, data: Any) -> dict[str, int]:
        """Each counter's largest value over the ranks (collective)."""
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, _loader_counts(data))
        out: dict[str, int] = {}
        for counts in gathered:
            for key, value in (counts or {}).items():
                out[key] = max(out.get(key, 0), int(value))
        return out

    def summary(self, data: Any) -> str:
        """The run's end line: records read, rejected and why, and where they are listed (collective)."""
        totals = self.totals(data)
        reasons = sorted((k[len(BY_REASON) :], v) for k, v in totals.items() if k.startswith(BY_REASON))
        why = f" ({', '.join(f'{r}: {n}' for r, n in reasons)})" if reasons else ""
        where = ""
        if reasons and self.folder:
            where = f"; listed in {os.path.join(self.folder, 'rejects-dp<R>.jsonl')} (one file per DP rank)"
        return (
            f"mmpack trainer: online packing: {totals.get(READ, 0)} records read, "
            f"{totals.get(REJECTED, 0)} rejected{why}{where}"
        )
