"""Shard storage: fsspec reads, a bounded LRU cache on local disk, sha256 checks, retries with backoff.

Several processes (loader workers, several ranks on one node) may share one cache folder: a per-shard
file lock makes exactly one of them download a shard, and one cache-wide lock serialises space accounting.
Space is reserved (a sparse `.part` file of the shard's size) before a download starts, so the sum of
file sizes in the cache never exceeds `cache_limit_bytes`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from dataloader.manifest import ShardInfo, join_url

CHUNK_BYTES = 4 << 20
_LOCK_SUFFIX, _PART_SUFFIX = ".lock", ".part"


class ShardError(RuntimeError):
    """A shard could not be read correctly; the message names it."""


@dataclass(kw_only=True, frozen=True)
class StorageConfig:
    """Where shards live and how they are fetched.

    root: dataset folder or URL. cache_dir: local cache for remote shards (None: a folder under the
    system temp dir). Local datasets are read in place, never copied.
    """

    root: str
    cache_dir: str | None = None
    cache_limit_bytes: int = 16 << 30
    storage_options: dict[str, Any] | None = None
    max_attempts: int = 6
    backoff_s: float = 0.1
    max_backoff_s: float = 4.0

    def __post_init__(self) -> None:
        if self.cache_limit_bytes <= 0:
            raise ValueError(f"cache_limit_bytes must be > 0, got {self.cache_limit_bytes}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")

    @property
    def is_local(self) -> bool:
        return "://" not in self.root or self.root.startswith("file://")


def resolve_storage_options(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """Fills the S3 endpoint from AWS_ENDPOINT_URL when the caller gave none."""
    opts = dict(storage_options or {})
    if url.startswith(("s3://", "s3a://")):
        client_kwargs = dict(opts.get("client_kwargs") or {})
        endpoint = opts.pop("endpoint_url", None) or client_kwargs.get("endpoint_url")
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            client_kwargs["endpoint_url"] = endpoint
            opts["client_kwargs"] = client_kwargs
    return opts


def local_root(root: str) -> str:
    return root[len("file://") :] if root.startswith("file://") else root


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _flock(path: str, *, blocking: bool = True) -> Iterator[bool]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


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
        return asdict(self)


class ShardStore:
    """Gives a verified local path for each shard, fetching it into the cache when needed."""

    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        self.metrics = StorageMetrics()
        self._verified: set[str] = set()
        self._fs: Any = None
        if config.is_local:
            self.cache_dir = ""
        else:
            import tempfile

            base = config.cache_dir or os.path.join(tempfile.gettempdir(), "mmpack-cache")
            tag = hashlib.sha256(config.root.rstrip("/").encode()).hexdigest()[:12]
            self.cache_dir = os.path.join(base, tag)
            os.makedirs(self.cache_dir, exist_ok=True)

    # -- public -------------------------------------------------------------------------------------------
    def local_path(self, shard: ShardInfo) -> str:
        """A local file holding exactly the manifest's bytes of `shard` (downloads on a miss)."""
        if self.config.is_local:
            return self._local_in_place(shard)
        path = self._cache_path(shard)
        if os.path.exists(path):
            self.metrics.cache_hits += 1
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)  # LRU order is mtime order
            return path
        self.metrics.cache_misses += 1
        self.fetch(shard)
        return path

    def fetch(self, shard: ShardInfo, *, wait: bool = True) -> bool:
        """Makes sure the shard is cached. With wait=False, returns False at once if another process holds it."""
        if self.config.is_local:
            return True
        path = self._cache_path(shard)
        with _flock(path + _LOCK_SUFFIX, blocking=wait) as got:
            if not got:
                return False
            if os.path.exists(path):
                with contextlib.suppress(FileNotFoundError):
                    os.utime(path)  # about to be used: most recently used
            else:
                self._download_verified(shard, path)
        return True

    # -- local ----------------------------------------------------------------------------------------------
    def _local_in_place(self, shard: ShardInfo) -> str:
        path = join_url(local_root(self.config.root), shard.path)
        if path not in self._verified:
            if not os.path.exists(path):
                raise ShardError(f"shard {shard.path} not found at {path}")
            digest = sha256_file(path)
            if digest != shard.sha256:
                raise ShardError(
                    f"shard {shard.path} at {path} is corrupted: sha256 {digest[:12]}... "
                    f"does not match the manifest's {shard.sha256[:12]}..."
                )
            self._verified.add(path)
            self.metrics.bytes_read += shard.bytes
        return path

    # -- remote ---------------------------------------------------------------------------------------------
    def _cache_path(self, shard: ShardInfo) -> str:
        # The digest is part of the name: a dataset rewritten at the same URL never reuses stale bytes.
        return os.path.join(self.cache_dir, f"{shard.sha256[:16]}-{shard.path.replace('/', '__')}")

    def _filesystem(self) -> Any:
        if self._fs is None:
            from fsspec.core import url_to_fs

            opts = resolve_storage_options(self.config.root, self.config.storage_options)
            self._fs, _ = url_to_fs(self.config.root, **opts)
        return self._fs

    def _download_verified(self, shard: ShardInfo, path: str) -> None:
        url = join_url(self.config.root, shard.path)
        part = path + _PART_SUFFIX
        self._reserve(shard, part)
        last_error = "unknown error"
        try:
            for attempt in range(self.config.max_attempts):
                if attempt:
                    self.metrics.retries += 1
                    delay = min(self.config.max_backoff_s, self.config.backoff_s * 2 ** (attempt - 1))
                    time.sleep(delay * (0.5 + random.random()))
                try:
                    digest, size = self._download_once(url, part)
                except FileNotFoundError as e:
                    raise ShardError(f"shard {shard.path} not found at {url}") from e
                except Exception as e:  # network errors come in many types (aiohttp, botocore, OSError)
                    last_error = f"{type(e).__name__}: {e}"
                    continue
                if size == shard.bytes and digest == shard.sha256:
                    os.replace(part, path)
                    return
                self.metrics.redownloads += 1
                last_error = (
                    f"got {size} bytes with sha256 {digest[:12]}..., manifest says "
                    f"{shard.bytes} bytes with sha256 {shard.sha256[:12]}..."
                )
                os.truncate(part, shard.bytes)  # keep the reservation for the next attempt
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
        raise ShardError(
            f"shard {shard.path} could not be read correctly from {url} after "
            f"{self.config.max_attempts} attempts; last error: {last_error}"
        )

    def _download_once(self, url: str, part: str) -> tuple[str, int]:
        fs = self._filesystem()
        h = hashlib.sha256()
        size = 0
        # block_size=0 streams plain HTTP bodies (no Range support needed); s3fs reads sequentially.
        open_kw: dict[str, Any] = {"block_size": 0} if url.startswith(("http://", "https://")) else {}
        with fs.open(url, "rb", **open_kw) as src, open(part, "r+b") as dst:
            while chunk := src.read(CHUNK_BYTES):
                h.update(chunk)
                dst.write(chunk)
                size += len(chunk)
        self.metrics.bytes_read += size
        return h.hexdigest(), size

    def _cache_entries(self) -> list[tuple[str, int, float]]:
        """(path, size, mtime) of every shard and reservation in the cache folder."""
        out = []
        for entry in os.scandir(self.cache_dir):
            if entry.name.endswith(_LOCK_SUFFIX):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat()
                out.append((entry.path, st.st_size, st.st_mtime))
        return out

    def _reserve(self, shard: ShardInfo, part: str) -> None:
        """Evicts least-recently-used shards until `shard.bytes` fits, then creates its sparse `.part`."""
        limit = self.config.cache_limit_bytes
        if shard.bytes > limit:
            raise ShardError(
                f"shard {shard.path} ({shard.bytes} bytes) is larger than cache_limit_bytes={limit}"
            )
        deadline = time.monotonic() + 120.0
        while True:
            with _flock(os.path.join(self.cache_dir, ".cache" + _LOCK_SUFFIX)):
                entries = self._cache_entries()
                used = sum(size for _, size, _ in entries)
                done = sorted((e for e in entries if not e[0].endswith(_PART_SUFFIX)), key=lambda e: e[2])
                for victim, size, _ in done:
                    if used + shard.bytes <= limit:
                        break
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(victim)
                        used -= size
                        self.metrics.evictions += 1
                if used + shard.bytes <= limit:
                    with open(part, "wb") as f:
                        f.truncate(shard.bytes)
                    return
            # Only other downloads' reservations are left: wait for them to finish.
            if time.monotonic() > deadline:
                raise ShardError(
                    f"no room in the cache for shard {shard.path}: cache_limit_bytes={limit} is held by "
                    "downloads in progress; raise cache_limit_bytes"
                )
            time.sleep(0.05)
