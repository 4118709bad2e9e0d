"""Counters of a shard store in one process."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StorageMetrics:
    """Counters of one process; `bytes_read` counts bytes pulled from storage (downloads and local reads)."""

    bytes_read: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    retries: int = 0
    redownloads: int = 0
    evictions: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))  # called per batch: a flat copy, not dataclasses.asdict's deep one
