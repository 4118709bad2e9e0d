"""Inputs as fsspec URLs (s3://, http(s)://): listing, identity, ranged reads with retries.

`RemoteFiles` reads them with the job's storage options (`--s3-endpoint`, or `ControlConfig.storage_options`);
the job context (`mmpack.offline_packing.context.JobContext.remote`) holds one per process. Every remote call
goes through `with_retries` (`mmpack.packing.retry`: transient errors only, with backoff), which names the
object in `InputReadError` once the attempts are spent; a missing object is never retried
(FileNotFoundError). Image headers are read through `RangedFile`: a seekable file that fetches only the
blocks Pillow touches (the header, and the end marker), never the whole image. `file://` URLs are plain local
paths (`local_path`), so they read exactly as the local file does.
"""

from __future__ import annotations

import io
import posixpath
import re
import urllib.parse
from collections.abc import Callable
from typing import IO, Any, TypeVar

from mmpack.packing.errors import MmpackError
from mmpack.packing.fileio import open_regular, resolve_storage_options
from mmpack.packing.ownership import MARKER_NAME
from mmpack.packing.retry import RetriesExhausted, RetryPolicy, retry_call

T = TypeVar("T")
HEADER_BLOCK_BYTES = 16 << 10  # image headers: blocks fetched on demand, a JPEG/PNG header is in the first
STREAM_BLOCK_BYTES = 8 << 20  # sequential reads (record files, tars)
RETRY = RetryPolicy(max_attempts=5, backoff_s=0.2, max_backoff_s=5.0)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # a scheme, not a `tar::` member reference
# Sizes just learnt by `identity`, taken (once) by the `open_ranged` that follows it: scan records an image's
# identity, then reads its header, with one stat between them instead of two. Bounded, and taken only once,
# so nothing kept outlives the read it was fetched for.
_JUST_STATED_MAX = 64


class InputReadError(MmpackError):
    """A remote input could not be read after all retries (not a per-sample reject: the job stops)."""

    default_reason = "input_unreadable"


def is_url(path: str) -> bool:
    """True for a remote fsspec URL (s3://, http(s)://, ...); local paths and file:// are not."""
    return _URL.match(path) is not None and not path.startswith("file://")


def local_path(path: str) -> str:
    """A `file://` URL as a local path; other paths unchanged."""
    return path[len("file://") :] if path.startswith("file://") else path


def with_retries(url: str, what: str, fn: Callable[[], T]) -> T:
    """`fn()`, retried on transient errors (`mmpack.packing.retry`); InputReadError naming `url` once the
    attempts are spent, or at once for another storage error (no permission, a bad request); a missing
    object raises FileNotFoundError."""
    try:
        return retry_call(fn, RETRY)
    except RetriesExhausted as exc:
        raise InputReadError(
            f"cannot {what} {url} after {exc.attempts} attempts ({type(exc.last).__name__}: {exc.last}); check "
            "the URL, the endpoint (--s3-endpoint) and the credentials, then rerun: finished chunks are kept"
        ) from None
    except FileNotFoundError:
        raise
    except OSError as exc:  # not transient: retrying gives the same answer
        raise InputReadError(
            f"cannot {what} {url} ({type(exc).__name__}: {exc}); check the URL and the credentials"
        ) from None


class RemoteFiles:
    """Remote objects read with one job's storage options; `caches` (the job context's) keeps the sizes
    `identity` just learnt for the `open_ranged` that follows."""

    def __init__(self, storage_options: dict | None, caches: Any = None):
        self.storage_options = dict(storage_options or {})
        self.caches = caches

    def filesystem(self, url: str) -> tuple[Any, str]:
        """(fsspec filesystem, path inside it) of a remote URL, with the job's options (S3 endpoint: the
        project's one rule, `mmpack.packing.fileio.resolve_storage_options`); object stores only: an S3
        endpoint means nothing to an http(s):// input."""
        from fsspec.core import url_to_fs

        if url.startswith(("http://", "https://")):
            return url_to_fs(url)
        return url_to_fs(url, **resolve_storage_options(url, self.storage_options))

    def info(self, url: str) -> dict[str, Any]:
        """fsspec `info` of a remote object (size, ETag or mtime); FileNotFoundError if it does not exist."""
        fs, path = self.filesystem(url)
        return with_retries(url, "stat", lambda: fs.info(path))

    def identity(self, url: str, verify: str) -> list:
        """[url, size, ETag or mtime] of a remote object, or [url, size, sha256] with verify="sha256";
        [url, None, None] for a missing one."""
        try:
            meta = self.info(url)
        except FileNotFoundError:
            return [url, None, None]
        size = meta.get("size")
        if isinstance(size, int) and self.caches is not None:
            self.caches.put("just_stated", url, size, _JUST_STATED_MAX)
        if verify == "sha256":
            import hashlib

            return [url, size, hashlib.sha256(self.read_range(url, 0, size)).hexdigest()]
        version = meta.get("ETag") or meta.get("etag") or meta.get("mtime") or meta.get("LastModified")
        return [url, size, str(version) if version is not None else None]

    def read_range(self, url: str, start: int, end: int | None) -> bytes:
        """Bytes [start, end) of a remote object (end None: to its end), with retries."""
        fs, path = self.filesystem(url)
        data: bytes = with_retries(url, "read", lambda: fs.cat_file(path, start=start, end=end))
        if (
            end is not None and len(data) > end - start and len(data) >= end
        ):  # a server ignoring Range sent all
            data = data[start:end]
        if end is not None and len(data) != end - start:
            raise InputReadError(f"{url}: asked for bytes {start}..{end}, got {len(data)}; was it rewritten?")
        return data

    def read_all(self, url: str) -> bytes:
        return self.read_range(url, 0, None)

    def expand(self, arg: str, suffixes: tuple[str, ...]) -> tuple[list[str], dict[str, int]]:
        """The input objects an -i URL names (an object, a prefix "folder" or a glob), sorted, as URLs; and the
        prefixes holding mmpack's marker (packed datasets or work folders, never raw input) whose objects were
        left out, as URLs, with how many each."""
        fs, path = self.filesystem(arg)
        protocol = arg.split("://", 1)[0]

        def as_url(p: str) -> str:
            return p if "://" in p else f"{protocol}://{p}"

        if protocol.startswith("http"):  # no listing over plain HTTP: one object per URL
            return ([arg] if arg.endswith(suffixes) else []), {}
        if any(ch in path for ch in "*?["):
            found = with_retries(arg, "list", lambda: fs.glob(path))
        elif with_retries(arg, "stat", lambda: fs.isdir(path)):
            found = with_retries(arg, "list", lambda: fs.find(path))
        else:
            found = [path] if with_retries(arg, "stat", lambda: fs.exists(path)) else []
        marked = sorted((p[: -len(MARKER_NAME)] for p in found if p.endswith(f"/{MARKER_NAME}")), key=len)
        kept: list[str] = []
        skipped: dict[str, int] = {}
        for p in sorted(p for p in found if p.endswith(suffixes) and not p.endswith(f"/{MARKER_NAME}")):
            folder = next((m for m in reversed(marked) if p.startswith(m)), None)  # the nearest marked prefix
            if folder is None:
                kept.append(as_url(p))
            else:
                url = as_url(folder.rstrip("/"))
                skipped[url] = skipped.get(url, 0) + 1
        return kept, skipped

    def open_ranged(self, url: str, block_bytes: int = HEADER_BLOCK_BYTES) -> RangedFile:
        """A `RangedFile` over a remote object (its size from the `identity` just taken, else one stat);
        FileNotFoundError if it does not exist."""
        size = self.caches.take("just_stated", url) if self.caches is not None else None
        return RangedFile(self, url, size if size is not None else int(self.info(url)["size"]), block_bytes)

    def open_binary(self, path: str) -> IO[bytes]:
        """A local file or a remote object opened for sequential or seeking binary reads (remote: 8 MiB
        ranged reads with retries, two blocks kept)."""
        if not is_url(path):
            return open_regular(local_path(path))
        raw = RangedFile(self, path, int(self.info(path)["size"]), STREAM_BLOCK_BYTES, max_blocks=2)
        return io.BufferedReader(raw, buffer_size=1 << 20)


def parent(url: str) -> str:
    """The "folder" of a remote object: its URL up to the last slash."""
    return url.rsplit("/", 1)[0]


def join_under(root: str, image: str) -> str:
    """The URL of relative path `image` under remote root `root`; PermissionError if it escapes the root.

    The path is checked as written and as a server reads it: percent-decoded (repeatedly, so `%252e` counts
    too), backslashes as slashes, then normalised, so `%2e%2e/secret.jpg` is refused before any request. An
    http(s) URL is then built from the decoded, normalised path, quoted once (what is checked is what is
    fetched); object-store keys are literal names (`%` is part of an S3 key), so theirs stays as written.
    """
    decoded = _decodings(image)
    for form in decoded:
        clean = posixpath.normpath(form.replace("\\", "/"))
        if clean == ".." or clean.startswith(("../", "/")) or "\x00" in clean:
            raise PermissionError(f"image path {image!r} escapes the image root {root}")
    if root.startswith(("http://", "https://")):
        rel = urllib.parse.quote(posixpath.normpath(decoded[-1]), safe="/!$&'()*+,;=:@~")
    else:
        rel = posixpath.normpath(image)
    return f"{root.rstrip('/')}/{rel}"


def _decodings(text: str, most: int = 4) -> list[str]:
    """`text` and its successive percent-decodings, until one changes nothing."""
    forms = [text]
    while len(forms) <= most and (decoded := urllib.parse.unquote(forms[-1])) != forms[-1]:
        forms.append(decoded)
    return forms


class RangedFile(io.RawIOBase):
    """A remote object as a seekable read-only file that fetches only the blocks read (retrying each).

    `fetched_bytes` counts what came over the network.
    """

    def __init__(
        self,
        files: RemoteFiles,
        url: str,
        size: int,
        block_bytes: int = HEADER_BLOCK_BYTES,
        max_blocks: int | None = None,
    ):
        super().__init__()
        self.files = files
        self.name = url
        self.size = size
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks  # None: keep every block (headers); a number: streaming reads
        self.fetched_bytes = 0
        self._blocks: dict[int, bytes] = {}
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.size - self._pos))
        if n == 0:
            return 0
        data = self._read(self._pos, n)
        view[:n] = data
        self._pos += n
        return n

    def _read(self, pos: int, n: int) -> bytes:
        first, last = pos // self.block_bytes, (pos + n - 1) // self.block_bytes
        missing = [b for b in range(first, last + 1) if b not in self._blocks]
        if missing:  # one request for the run of missing blocks (they are contiguous in practice)
            lo = missing[0] * self.block_bytes
            hi = min(self.size, (missing[-1] + 1) * self.block_bytes)
            data = self.files.read_range(self.name, lo, hi)
            self.fetched_bytes += len(data)
            for b in range(missing[0], missing[-1] + 1):
                k = (b - missing[0]) * self.block_bytes
                self._blocks[b] = data[k : k + self.block_bytes]
        joined = b"".join(self._blocks[b] for b in range(first, last + 1))
        if self.max_blocks is not None:
            for b in list(self._blocks)[: max(0, len(self._blocks) - self.max_blocks)]:
                del self._blocks[b]  # oldest first
        start = pos - first * self.block_bytes
        return joined[start : start + n]
