"""Shard storage: fsspec reads, a bounded LRU cache on local disk, sha256 checks, retries with backoff.

Several processes (loader workers, several ranks on one node) may share one cache folder: a per-shard
file lock makes exactly one of them download a shard, and one cache-wide lock serialises space accounting.
Space is reserved (a sparse `.part` file of the shard's size) before a download starts, so the sum of
file sizes in the cache never exceeds `cache_limit_bytes`.

Cache folder layout: `<cache_dir>/<sha256[:16]>-<shard path>` (verified shards), `....part` (downloads in
progress), and `.locks/` with the cache-wide lock plus one empty lock file per shard ever cached. Lock files
are never deleted (another process may be waiting on one); they take no space and are not counted.

`.meta/` (also made for local datasets, which are read in place) holds small per-shard facts shared by every
process on the machine, so each is worked out once rather than once per loader worker and rank: the tar
index of a WebDataset shard (`<sha256>.tar-index.json`, valid for any file with that content), and for local
shards a record that the file at a path, with its size, mtime and inode, was checked against its sha256
(`<sha256>.verified.json`; a file rewritten in place with all three unchanged would not be checked again;
an flock on the shard file makes one process check it while the others wait for the record). They are a few KB each
and not counted in `cache_limit_bytes`.

A `ShardStore` may be used by several threads at once (the loader's prefetcher runs
`download_concurrency` downloads in parallel): flock locks belong to an open file description, so two
threads of one process exclude each other exactly as two processes do; counters and the shared fsspec
filesystem are guarded by a lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import time
from typing import Any

from mmpack.dataloader.manifest import ShardInfo, join_url
from mmpack.dataloader.storage.config import ShardError, StorageConfig, local_root
from mmpack.dataloader.storage.locks import flock
from mmpack.dataloader.storage.metrics import StorageMetrics
from mmpack.dataloader.storage.records import (
    CHUNK_BYTES,
    file_stamp,
    read_json,
    sha256_file,
    write_json_atomic,
)
from mmpack.packing.fileio import resolve_storage_options
from mmpack.packing.retry import RetriesExhausted, RetryPolicy, is_transient, retry_call

# Shards up to this size are read with one GET (`cat_file`) and held in memory once; bigger ones stream.
WHOLE_READ_MAX_BYTES = 64 << 20
_LOCK_SUFFIX, _PART_SUFFIX, _LOCK_DIR, _META_DIR = ".lock", ".part", ".locks", ".meta"


class ShardStore:
    """Gives a verified local path for each shard, fetching it into the cache when needed (thread-safe)."""

    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        self.metrics = StorageMetrics()
        self._verified: set[str] = set()
        self._fs: Any = None
        self._real_root: str | None = None
        self._lock = threading.Lock()  # guards metrics, _verified and the lazy filesystem
        import tempfile

        base = config.cache_dir or os.path.join(tempfile.gettempdir(), "mmpack-cache")
        tag = hashlib.sha256(config.root.rstrip("/").encode()).hexdigest()[:12]
        self.meta_dir = os.path.join(base, tag, _META_DIR)
        try:
            os.makedirs(self.meta_dir, exist_ok=True)
        except OSError:  # facts are an optimisation: without a writable folder, each process works them out
            self.meta_dir = ""
        if config.is_local:
            self.cache_dir = ""
        else:
            self.cache_dir = os.path.join(base, tag)
            check_cache_dir(self.cache_dir, config.root)

    # -- public -------------------------------------------------------------------------------------------
    def local_path(self, shard: ShardInfo) -> str:
        """A local file holding exactly the manifest's bytes of `shard` (downloads on a miss)."""
        if self.config.is_local:
            local = self._local_in_place(shard)
            assert local is not None  # waited for the lock
            return local
        path = self._cache_path(shard)
        if os.path.exists(path) and self._cached_ok(shard, path):
            self._count("cache_hits")
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)  # LRU order is mtime order
            return path
        self._count("cache_misses")
        self.fetch(shard)
        return path

    def fetch(self, shard: ShardInfo, *, wait: bool = True, cancel: threading.Event | None = None) -> bool:
        """Makes sure the shard is cached (local shards: checked; the loader's workers ask the kernel to read
        them ahead, `mmpack.dataloader.worker.LocalReadAhead`).

        With wait=False, returns False at once if another process or thread holds it. Setting `cancel`
        makes a download in progress give up (ShardError) at its next chunk, retry or wait."""
        if self.config.is_local:
            return self._local_in_place(shard, wait=wait) is not None
        path = self._cache_path(shard)
        with flock(self._lock_path(os.path.basename(path)), blocking=wait) as got:
            if not got:
                return False
            if os.path.exists(path) and self._cached_ok(shard, path):
                with contextlib.suppress(FileNotFoundError):
                    os.utime(path)  # about to be used: most recently used
            else:
                self._download_verified(shard, path, cancel)
        return True

    def is_cached(self, shard: ShardInfo) -> bool:
        """A remote shard's checked bytes are in the cache now (one `stat`; it may be evicted later)."""
        return not self.config.is_local and os.path.exists(self._cache_path(shard))

    def verified_path(self, shard: ShardInfo) -> str:
        """Where the shard's checked bytes are once `fetch` returned True (nothing is counted or fetched)."""
        return (
            join_url(local_root(self.config.root), shard.path)
            if self.config.is_local
            else self._cache_path(shard)
        )

    def index_cache_path(self, shard: ShardInfo) -> str | None:
        """Where the tar index of this shard's content is shared on this machine (None: not shared)."""
        if not self.meta_dir or shard.format != "wds":
            return None
        return os.path.join(self.meta_dir, f"{shard.sha256}.tar-index.json")

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.metrics, name, getattr(self.metrics, name) + n)

    # -- local ----------------------------------------------------------------------------------------------
    def _local_in_place(self, shard: ShardInfo, *, wait: bool = True) -> str | None:
        """The path of a local shard, checked against its sha256 once per machine (None: wait=False and
        another process or thread is checking it)."""
        path = self.verified_path(shard)
        if path in self._verified:
            return path
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ShardError(f"shard {shard.path} not found at {path}") from None
        stamp = {"path": self._real_path(shard), **file_stamp(st, shard)}
        marker = os.path.join(self.meta_dir, f"{shard.sha256}.verified.json") if self.meta_dir else ""
        if not (marker and read_json(marker) == stamp):
            # One checker per shard at a time; the others wait for its record instead of hashing too. The
            # lock is held on the shard file itself: creating a lock file per shard costs more than the check
            # of a small shard on some disks.
            locked = flock(path, blocking=wait, create=False) if marker else contextlib.nullcontext(True)
            with locked as got:
                if not got:
                    return None
                if not (marker and read_json(marker) == stamp):
                    digest = sha256_file(path)
                    if digest != shard.sha256:
                        raise ShardError(
                            f"shard {shard.path} at {path} is corrupted: sha256 {digest[:12]}... "
                            f"does not match the manifest's {shard.sha256[:12]}..."
                        )
                    if marker:
                        write_json_atomic(marker, stamp)
        with self._lock:
            if path not in self._verified:
                self._verified.add(path)
                self.metrics.bytes_read += shard.bytes
        return path

    def _real_path(self, shard: ShardInfo) -> str:
        """The shard's path with the dataset folder's symbolic links resolved (resolved once per store: the
        shard path below it is relative, without `..`, as the manifest model checks; the file's own identity
        is in the stamp's inode and device)."""
        if self._real_root is None:
            self._real_root = os.path.realpath(local_root(self.config.root))
        return os.path.join(self._real_root, shard.path)

    # -- remote ---------------------------------------------------------------------------------------------
    def _cached_ok(self, shard: ShardInfo, path: str) -> bool:
        """Whether the cached copy of a remote shard still holds the manifest's bytes, checked the first time
        this process uses it: its size, mtime and inode against the record written when it was verified (a
        `stat`), and its sha256 when they differ or there is no record. A bad copy is removed (False: fetch
        it again), never used."""
        if path in self._verified:
            return True
        try:
            st = os.stat(path)
            stamp = file_stamp(st, shard)
            record = self._cached_record(shard)
            if not (record and read_json(record) == stamp):
                if st.st_size != shard.bytes or sha256_file(path) != shard.sha256:
                    os.unlink(path)
                    self._count("redownloads")
                    print(
                        f"mmpack loader: the cached copy {path} of shard {shard.path} is damaged; fetching it again",
                        file=sys.stderr,
                    )
                    return False
                if record:
                    write_json_atomic(record, stamp)
        except FileNotFoundError:  # evicted by another process meanwhile
            return False
        with self._lock:
            self._verified.add(path)
        return True

    def _cached_record(self, shard: ShardInfo) -> str:
        return os.path.join(self.meta_dir, f"{shard.sha256}.cached.json") if self.meta_dir else ""

    def _cache_path(self, shard: ShardInfo) -> str:
        # The digest is part of the name: a dataset rewritten at the same URL never reuses stale bytes.
        return os.path.join(self.cache_dir, f"{shard.sha256[:16]}-{shard.path.replace('/', '__')}")

    def _lock_path(self, name: str) -> str:
        return os.path.join(self.cache_dir, _LOCK_DIR, name + _LOCK_SUFFIX)

    def _filesystem(self) -> Any:
        with self._lock:
            if self._fs is None:
                from fsspec.core import url_to_fs

                opts = resolve_storage_options(self.config.root, self.config.storage_options)
                fs, _ = url_to_fs(self.config.root, **opts)
                if getattr(fs, "async_impl", False) and hasattr(fs, "set_session"):
                    # Create the client now: first calls from several threads at once would each make one.
                    from fsspec.asyn import sync

                    sync(fs.loop, fs.set_session)
                self._fs = fs
            return self._fs

    def _download_verified(self, shard: ShardInfo, path: str, cancel: threading.Event | None) -> None:
        """Downloads `shard` to `path` and checks it against the manifest, retrying transient errors and
        bodies cut or changed in transit (`mmpack.packing.retry`)."""
        url = join_url(self.config.root, shard.path)
        part = path + _PART_SUFFIX
        self._reserve(shard, part, cancel)

        def attempt() -> None:
            if cancel is not None and cancel.is_set():
                raise ShardError(f"download of shard {shard.path} cancelled")
            try:
                digest, size = self._download_once(url, part, shard.bytes, cancel)
            except FileNotFoundError as e:
                raise ShardError(f"shard {shard.path} not found at {url}") from e
            except _Cancelled:
                raise ShardError(f"download of shard {shard.path} cancelled") from None
            if size != shard.bytes or digest != shard.sha256:
                self._count("redownloads")
                os.truncate(part, shard.bytes)  # keep the reservation for the next attempt
                raise _Mismatch(
                    f"got {size} bytes with sha256 {digest[:12]}..., manifest says "
                    f"{shard.bytes} bytes with sha256 {shard.sha256[:12]}..."
                )
            # Under the cache lock: a rename racing a space scan's directory listing can hide both
            # names from it, and the scan would then hand out space this shard holds.
            with flock(self._lock_path(".cache")):
                os.replace(part, path)
            if record := self._cached_record(shard):  # what later processes check their use against
                write_json_atomic(record, file_stamp(os.stat(path), shard))
            with self._lock:
                self._verified.add(path)

        policy = RetryPolicy(
            max_attempts=self.config.max_attempts,
            backoff_s=self.config.backoff_s,
            max_backoff_s=self.config.max_backoff_s,
        )
        try:
            retry_call(
                attempt,
                policy,
                transient=lambda e: isinstance(e, _Mismatch) or is_transient(e),
                on_retry=lambda n, e: self._count("retries"),
                sleep=lambda seconds: _sleep(seconds, cancel, shard),
            )
        except RetriesExhausted as e:
            raise ShardError(
                f"shard {shard.path} could not be read correctly from {url} after {e.attempts} attempts; "
                f"last error: {type(e.last).__name__}: {e.last}"
            ) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)

    def _download_once(
        self, url: str, part: str, expected_bytes: int, cancel: threading.Event | None
    ) -> tuple[str, int]:
        """Writes the object at `url` into `part`; returns its sha256 and size (a short body shows there)."""
        fs = self._filesystem()
        h = hashlib.sha256()
        size = 0
        with open(part, "r+b") as dst:
            if expected_bytes <= WHOLE_READ_MAX_BYTES:
                # One GET. s3fs's open() (and cat_file with max_concurrency > 1) sends a HEAD first, and on
                # small objects that round trip costs as much as the body.
                kw: dict[str, Any] = {"max_concurrency": 1} if url.startswith(("s3://", "s3a://")) else {}
                data = fs.cat_file(url, **kw)
                h.update(data)
                dst.write(data)
                size = len(data)
            else:
                # block_size=0 streams plain HTTP bodies (no Range support needed); s3fs reads sequentially.
                open_kw: dict[str, Any] = {"block_size": 0} if url.startswith(("http://", "https://")) else {}
                with fs.open(url, "rb", **open_kw) as src:
                    while chunk := src.read(CHUNK_BYTES):
                        if cancel is not None and cancel.is_set():
                            raise _Cancelled
                        h.update(chunk)
                        dst.write(chunk)
                        size += len(chunk)
        self._count("bytes_read", size)
        return h.hexdigest(), size

    def _cache_entries(self) -> list[tuple[str, int, float]]:
        """(path, size, mtime) of every shard and reservation in the cache folder."""
        out = []
        for entry in os.scandir(self.cache_dir):
            # `.locks/` is a folder; top-level `.lock` files are left by older versions.
            if entry.name.endswith(_LOCK_SUFFIX) or not entry.is_file(follow_symlinks=False):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat()
                out.append((entry.path, st.st_size, st.st_mtime))
        return out

    def _reserve(self, shard: ShardInfo, part: str, cancel: threading.Event | None = None) -> None:
        """Evicts least-recently-used shards until `shard.bytes` fits, then creates its sparse `.part`."""
        limit = self.config.cache_limit_bytes
        if shard.bytes > limit:
            raise ShardError(
                f"shard {shard.path} ({shard.bytes} bytes) is larger than cache_limit_bytes={limit}"
            )
        deadline = time.monotonic() + 120.0
        while True:
            with flock(self._lock_path(".cache")):
                entries = self._cache_entries()
                used = sum(size for _, size, _ in entries)
                done = sorted((e for e in entries if not e[0].endswith(_PART_SUFFIX)), key=lambda e: e[2])
                for victim, size, _ in done:
                    if used + shard.bytes <= limit:
                        break
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(victim)
                        used -= size
                        self._count("evictions")
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
            _sleep(0.05, cancel, shard)


class _Cancelled(Exception):
    pass


class _Mismatch(Exception):
    """A downloaded body whose size or sha256 differs from the manifest's (cut or changed in transit)."""


def check_cache_dir(cache_dir: str, root: str) -> None:
    """Make the cache folder of a remote dataset (and its lock folder), and check a file can be created there:
    ShardError in one line otherwise, before any loader worker starts."""
    try:
        os.makedirs(os.path.join(cache_dir, _LOCK_DIR), exist_ok=True)
        probe = os.path.join(cache_dir, _LOCK_DIR, f".write-check-{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as exc:
        raise ShardError(
            f"the cache folder {cache_dir} of the remote dataset {root} cannot be written ({exc.strerror or exc}); "
            "give a writable cache_dir (--data-cache-dir for the trainer) or fix its permissions"
        ) from None


def _sleep(seconds: float, cancel: threading.Event | None, shard: ShardInfo) -> None:
    """Sleeps, or raises ShardError at once when `cancel` is set."""
    if cancel is None:
        time.sleep(seconds)
    elif cancel.wait(seconds):
        raise ShardError(f"download of shard {shard.path} cancelled")
