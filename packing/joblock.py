"""One job at a time per folder: an exclusive lock that a second job finds at once, naming its holder.

`hold_lock(url)` holds the lock of a folder for the duration of a block; a second holder gets `FolderLocked`
right away (it never waits), with the first one's host, pid, command and start time.

- Local folders: an `fcntl.flock` on `<folder>/.mmpack-lock`, which also holds the holder's description. The
  kernel drops the lock when the holder's process ends, however it ends, so a local lock is never stale.
- S3 (`s3://`): a lease object `<folder>/.mmpack-lock`, created with a conditional put (`If-None-Match: *`: of
  two jobs, exactly one creates it). The holder renews it every `renew_s` (a put conditional on the ETag it
  wrote, `If-Match`) and deletes it at the end. A lease is stale when not renewed for `ttl_s` (its holder
  was killed or lost the network), or at once when it names a process of this host that no longer runs;
  a new job then takes it over with a put conditional on the stale lease's ETag, so of two jobs taking over
  the same stale lease only one wins. A holder whose renewal finds another job's lease has lost it: `check()`
  raises `FolderLocked` (the job stops at its next stage). Clocks of different hosts are compared, so
  `ttl_s` (10 minutes) must exceed their skew by far.
- Other fsspec stores: the same lease without conditional writes (create if absent, then read it back),
  which two jobs starting in the same second can both pass.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mmpack.packing.errors import MmpackError
from mmpack.packing.fileio import json_bytes, resolve_storage_options
from mmpack.packing.ownership import is_local

LOCK_NAME = ".mmpack-lock"


class FolderLocked(MmpackError):
    """Another job holds the folder's lock (or took over this job's lease); the message names it."""

    default_reason = "folder_locked"


@dataclass(kw_only=True, frozen=True)
class LeaseConfig:
    """Lease timing on object stores: renewed every `renew_s`, stale after `ttl_s` without a renewal."""

    ttl_s: float = 600.0
    renew_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.renew_s < self.ttl_s:
            raise ValueError(f"need 0 < renew_s < ttl_s, got renew_s={self.renew_s}, ttl_s={self.ttl_s}")


def holder_info(command: str | None = None) -> dict[str, Any]:
    """Who this process is: host, pid, command line and the time now (UTC)."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "command": command or " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]])[:300],
        "started": _now_iso(),
    }


def describe_holder(info: dict[str, Any] | None) -> str:
    """ "pid 12 on node-3 (mmpack pack ..., since 2025-...Z)", or a note that the holder is not known yet."""
    if not info:
        return "a job that is just starting (no holder recorded yet)"
    return f"pid {info.get('pid')} on {info.get('host')} ({info.get('command', '?')}, since {info.get('started')})"


class JobLock:
    """A held lock (from `hold_lock`): `check()` raises `FolderLocked` if an object-store lease was lost."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.lost_to: dict[str, Any] | None = None
        self.took_over: dict[str, Any] | None = None  # the stale lease this job replaced, if any

    def check(self) -> None:
        if self.lost_to is not None:
            raise FolderLocked(
                f"{self.role}: this job's lease was taken over by {describe_holder(self.lost_to)} (it was not "
                "renewed in time); stop the other job or wait for it, then rerun to resume"
            )


@contextlib.contextmanager
def hold_lock(
    url: str,
    *,
    role: str | None = None,
    storage_options: dict[str, Any] | None = None,
    command: str | None = None,
    lease: LeaseConfig | None = None,
) -> Iterator[JobLock]:
    """Hold the lock of folder `url` (created if missing) inside the block; see the module docstring.

    Raises:
        FolderLocked: another job holds it; the message names that job and what to do.
    """
    what = f"{role or 'folder'} {url}"
    info = holder_info(command)
    if is_local(url):
        path = url[len("file://") :] if url.startswith("file://") else url
        with _local_lock(os.path.join(path, LOCK_NAME), what, info) as lock:
            yield lock
        return
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(url, **resolve_storage_options(url, storage_options))
    with _lease(fs, f"{root.rstrip('/')}/{LOCK_NAME}", what, info, lease or LeaseConfig()) as lock:
        yield lock


@contextlib.contextmanager
def _local_lock(path: str, what: str, info: dict[str, Any]) -> Iterator[JobLock]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for _ in range(5):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_json_fd(fd)
            os.close(fd)
            raise FolderLocked(
                f"{what} is in use by another mmpack job: {describe_holder(holder)}; wait for it to end "
                "(or stop it), then rerun"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder before us removed the file as we opened it: lock the new one
    else:
        raise FolderLocked(f"{what}: cannot take its lock file {path} (it keeps being replaced)")
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json_bytes(info))
        yield JobLock(what)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still locked: a job opening it now retries on the new file
        os.close(fd)


def _read_json_fd(fd: int) -> dict[str, Any] | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 1 << 16)
        doc = json.loads(data) if data else None
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


@contextlib.contextmanager
def _lease(fs: Any, key: str, what: str, info: dict[str, Any], cfg: LeaseConfig) -> Iterator[JobLock]:
    store = _LeaseStore(fs, key)
    lock = JobLock(what)
    body = {**info, "renewed": _now_iso(), "ttl_s": cfg.ttl_s}
    etag = store.create(body)
    if etag is None:
        current, current_etag = store.read()
        if current is not None and not _is_stale(current, cfg):
            raise FolderLocked(
                f"{what} is in use by another mmpack job: {describe_holder(current)} (lease renewed "
                f"{current.get('renewed')}; it expires {cfg.ttl_s:.0f} s after its last renewal if that job "
                "is gone); wait for it to end, then rerun"
            )
        etag = store.replace(body, current_etag)
        if etag is None:
            holder, _ = store.read()
            raise FolderLocked(f"{what} was just taken by another mmpack job: {describe_holder(holder)}")
        lock.took_over = current
        print(f"mmpack: took over the stale lease of {what} from {describe_holder(current)}", file=sys.stderr)
    stop = threading.Event()
    state = {"etag": etag}
    renewer = threading.Thread(
        target=_renew, args=(store, body, state, lock, stop, cfg.renew_s), daemon=True, name="mmpack-lease"
    )
    renewer.start()
    try:
        yield lock
    finally:
        stop.set()
        renewer.join(timeout=30)
        if lock.lost_to is None:
            store.delete(state["etag"])


def _renew(
    store: _LeaseStore, body: dict, state: dict, lock: JobLock, stop: threading.Event, every_s: float
) -> None:
    while not stop.wait(every_s):
        try:
            etag = store.replace({**body, "renewed": _now_iso()}, state["etag"])
        except Exception:  # a network error: the next renewal tries again, well within the lease
            continue
        if etag is None:
            lock.lost_to, _ = store.read()
            lock.lost_to = lock.lost_to or {}
            return
        state["etag"] = etag


class _LeaseStore:
    """The lease object: conditional create / replace / delete on S3, plain ones elsewhere."""

    def __init__(self, fs: Any, key: str) -> None:
        self.fs, self.key = fs, key
        self.conditional = type(fs).__name__ == "S3FileSystem"
        if self.conditional:
            self.bucket, _, self.obj = key.partition("/")

    def create(self, body: dict) -> str | None:
        """Creates the lease; its ETag, or None if a lease exists already."""
        data = json_bytes(body)
        if self.conditional:
            try:
                return str(
                    self.fs.call_s3(
                        "put_object", Bucket=self.bucket, Key=self.obj, Body=data, IfNoneMatch="*"
                    )["ETag"]
                )
            except FileExistsError:
                return None
        if self.fs.exists(self.key):
            return None
        self.fs.pipe_file(self.key, data)
        return self._etag_if_mine(body)

    def replace(self, body: dict, etag: str | None) -> str | None:
        """Writes the lease if it is still the version `etag`; its new ETag, or None if it changed."""
        data = json_bytes(body)
        if self.conditional:
            kw = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
            try:
                return str(
                    self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.obj, Body=data, **kw)["ETag"]
                )
            except (FileExistsError, FileNotFoundError):
                return None
            except OSError as exc:
                if "pre-condition" in str(exc).lower() or "precondition" in str(exc).lower():
                    return None
                raise
        if self._etag() != etag:
            return None
        self.fs.pipe_file(self.key, data)
        return self._etag_if_mine(body)

    def read(self) -> tuple[dict[str, Any] | None, str | None]:
        """(the lease, its ETag), read ETag first: a lease renewed in between then fails a replace."""
        etag = self._etag()
        try:
            doc = json.loads(self.fs.cat_file(self.key))
        except FileNotFoundError:
            return None, None
        except ValueError:
            return {}, etag
        return (doc if isinstance(doc, dict) else {}), etag

    def delete(self, etag: str | None) -> None:
        """Deletes the lease if it is still this job's (`etag`)."""
        with contextlib.suppress(FileNotFoundError, OSError):
            if self.conditional and etag:
                self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.obj, IfMatch=etag)
            elif self._etag() == etag:
                self.fs.rm_file(self.key)
            self.fs.invalidate_cache(self.key)

    def _etag(self) -> str | None:
        try:
            self.fs.invalidate_cache(self.key)
            meta = self.fs.info(self.key)
        except FileNotFoundError:
            return None
        tag = meta.get("ETag") or meta.get("etag") or meta.get("mtime") or meta.get("LastModified")
        return str(tag) if tag is not None else json.dumps(meta, sort_keys=True, default=str)

    def _etag_if_mine(self, body: dict) -> str | None:
        current, etag = self.read()
        return (
            etag
            if current is not None
            and current.get("pid") == body["pid"]
            and current.get("host") == body["host"]
            and current.get("started") == body["started"]
            else None
        )


def _is_stale(lease: dict[str, Any], cfg: LeaseConfig) -> bool:
    """Not renewed for `ttl_s`, or held by a process of this host that is gone."""
    if lease.get("host") == socket.gethostname() and isinstance(lease.get("pid"), int):
        try:
            os.kill(lease["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # alive, another user's
    renewed = _parse_iso(lease.get("renewed"))
    return renewed is None or time.time() - renewed > float(lease.get("ttl_s") or cfg.ttl_s)


def _now_iso() -> str:
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    return now.isoformat().replace("+00:00", "Z")


def _parse_iso(text: Any) -> float | None:
    try:
        return datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
