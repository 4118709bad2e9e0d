"""Shard storage: fsspec reads, a bounded LRU cache on local disk, sha256 checks, retries with backoff.

config.py (StorageConfig, ShardError), store.py (ShardStore: local checks, cache reservation and eviction,
downloads), locks.py (flock), metrics.py (StorageMetrics), records.py (sha256 of a file, atomic JSON
records). See store.py for the cache layout and the locking rules.
"""

from __future__ import annotations

from mmpack.dataloader.storage.config import ShardError, StorageConfig, local_root
from mmpack.dataloader.storage.locks import flock
from mmpack.dataloader.storage.metrics import StorageMetrics
from mmpack.dataloader.storage.records import read_json, sha256_file, write_json_atomic
from mmpack.dataloader.storage.store import CHUNK_BYTES, WHOLE_READ_MAX_BYTES, ShardStore
from mmpack.packing.fileio import resolve_storage_options

__all__ = [
    "CHUNK_BYTES",
    "WHOLE_READ_MAX_BYTES",
    "ShardError",
    "ShardStore",
    "StorageConfig",
    "StorageMetrics",
    "flock",
    "local_root",
    "read_json",
    "resolve_storage_options",
    "sha256_file",
    "write_json_atomic",
]
