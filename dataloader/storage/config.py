"""Where shards live and how they are fetched (`StorageConfig`), and the error that names a bad shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ShardError(RuntimeError):
    """A shard could not be read correctly; the message names it."""


@dataclass(kw_only=True, frozen=True)
class StorageConfig:
    """Where shards live and how they are fetched.

    root: dataset folder or URL. cache_dir: local cache for remote shards (None: a folder under the
    system temp dir). Local datasets are read in place, never copied. download_concurrency: downloads the
    prefetcher of each loader worker keeps in flight.
    """

    root: str
    cache_dir: str | None = None
    cache_limit_bytes: int = 16 << 30
    storage_options: dict[str, Any] | None = None
    max_attempts: int = 6
    backoff_s: float = 0.1
    max_backoff_s: float = 4.0
    download_concurrency: int = 4

    def __post_init__(self) -> None:
        if self.cache_limit_bytes <= 0:
            raise ValueError(f"cache_limit_bytes must be > 0, got {self.cache_limit_bytes}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.download_concurrency < 1:
            raise ValueError(f"download_concurrency must be >= 1, got {self.download_concurrency}")

    @property
    def is_local(self) -> bool:
        return "://" not in self.root or self.root.startswith("file://")


def local_root(root: str) -> str:
    return root[len("file://") :] if root.startswith("file://") else root
