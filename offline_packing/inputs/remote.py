"""Inputs as fsspec URLs (s3://, http(s)://): listing, identity, ranged reads with retries.

Every remote read goes through `read_range`, which retries transient errors with exponential backoff and
jitter and, when the attempts are spent, raises `InputReadError` naming the object. A missing object is
never retried (FileNotFoundError). Image headers are read through `RangedFile`: a seekable file that
fetches only the blocks Pillow touches (the header, and the end marker), never the whole image.

The storage options of the job (`--s3-endpoint`, or the options of `PackJobConfig.storage_options`) are
process-wide here (`configure`): forked workers inherit them, and the Ray engine sends them to its workers.
`file://` URLs are plain local paths (`local_path`), so they read exactly as the local file does.
"""

from __future__ import annotations

import io
import posixpath
import random
import re
import time
import urllib.parse
from collections.abc import Callable
from typing import IO, Any, TypeVar

from mmpack.packing.errors import MmpackError
from mmpack.packing.ownership import MARKER_NAME

T = TypeVar("T")
HEADER_BLOCK_BYTES = 16 << 10  # image headers: blocks fetched on demand, a JPEG/PNG header is in the first
MAX_ATTEMPTS = 5
BACKOFF_S = 0.2
MAX_BACKOFF_S = 5.0
_OPTIONS: dict[str, Any] = {}
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # a scheme, not a `tar::` member reference
# Sizes just learnt by `identity`, taken (once) by the `open_ranged` that follows it: scan records an image's
# identity, then reads its header, with one stat between them instead of two. Bounded, and taken only once,
# so nothing here outlives the read it was fetched for.
_JUST_STATED: dict[str, int] = {}
_JUST_STATED_MAX = 64


class InputReadError(MmpackError):
    """A remote input could not be read after all retries (not a per-sample reject: the job stops)."""

    default_reason = "input_unreadable"


def configure(storage_options: dict | None) -> None:
    """Set the fsspec options (endpoint, credentials) every remote input of this process is opened with."""
    _OPTIONS.clear()
    _OPTIONS.update(storage_options or {})


def current_options() -> dict[str, Any]:
    return dict(_OPTIONS)


def is_url(path: str) -> bool:
    """True for a remote fsspec URL (s3://, http(s)://, ...); local paths and file:// are not."""
    return _URL.match(path) is not None and not path.startswith("file://")


def local_path(path: str) -> str:
    """A `file://` URL as a local path; other paths unchanged."""
    return path[len("file://") :] if path.startswith("file://") else path


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) of a remote URL, with the configured options (S3 endpoint: the
    project's one rule, `mmpack.packing.fileio.resolve_storage_options`); object stores only: an S3 endpoint means
    nothing to an http(s):// input."""
    from fsspec.core import url_to_fs

    from mmpack.packing.fileio import resolve_storage_options

    if url.startswith(("http://", "https://")):
        return url_to_fs(url)
    return url_to_fs(url, **resolve_storage_options(url, _OPTIONS))


def with_retries(url: str, what: str, fn: Callable[[], T]) -> T:
    """`fn()`, retried with backoff on any error but a missing object; InputReadError naming `url` at last."""
    last = ""
    for attempt in range(MAX_ATTEMPTS):
        if attempt:
            delay = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (attempt - 1))
            time.sleep(delay * (0.5 + random.random()))
        try:
            return fn()
        except FileNotFoundError:
            raise
        except Exception as exc:  # network errors come in many types (aiohttp, botocore, OSError)
            last = f"{type(exc).__name__}: {exc}"
    raise InputReadError(
        f"cannot {what} {url} after {MAX_ATTEMPTS} attempts ({last}); check the URL, the endpoint "
        "(--s3-endpoint) and the credentials, then rerun: finished chunks are kept"
    )


def info(url: str) -> dict[str, Any]:
    """fsspec `info` of a remote object (size, ETag or mtime); FileNotFoundError if it does not exist."""
    fs, path = filesystem(url)
    return with_retries(url, "stat", lambda: fs.info(path))


def identity(url: str, verify: str) -> list:
    """[url, size, ETag or mtime] of a remote object, or [url, size, sha256] with verify="sha256";
    [url, None, None] for a missing one."""
    try:
        meta = info(url)
    except FileNotFoundError:
        return [url, None, None]
    size = meta.get("size")
    if isinstance(size, int):
        if len(_JUST_STATED) >= _JUST_STATED_MAX:
            _JUST_STATED.pop(next(iter(_JUST_STATED)))
        _JUST_STATED[url] = size
    if verify == "sha256":
        import hashlib

        return [url, size, hashlib.sha256(read_range(url, 0, size)).hexdigest()]
    version = meta.get("ETag") or meta.get("etag") or meta.get("mtime") or meta.get("LastModified")
    return [url, size, str(version) if version is not None else None]


def read_range(url: str, start: int, end: int | None) -> bytes:
    """Bytes [start, end) of a remote object (end None: to its end), with retries."""
    fs, path = filesystem(url)
    data: bytes = with_retries(url, "read", lambda: fs.cat_file(path, start=start, end=end))
    if end is not None and len(data) > end - start and len(data) >= end:  # a server ignoring Range sent all
        data = data[start:end]
    if end is not None and len(data) != end - start:
        raise InputReadError(f"{url}: asked for bytes {start}..{end}, got {len(data)}; was it rewritten?")
    return data


def read_all(url: str) -> bytes:
    return read_range(url, 0, None)


def expand(arg: str, suffixes: tuple[str, ...]) -> list[str]:
    """The input objects an -i URL names (an object, a prefix "folder" or a glob), sorted, as URLs."""
    fs, path = filesystem(arg)
    protocol = arg.split("://", 1)[0]

    def as_url(p: str) -> str:
        return p if "://" in p else f"{protocol}://{p}"

    if protocol.startswith("http"):  # no listing over plain HTTP: one object per URL
        return [arg] if arg.endswith(suffixes) else []
    if any(ch in path for ch in "*?["):
        found = with_retries(arg, "list", lambda: fs.glob(path))
    elif with_retries(arg, "stat", lambda: fs.isdir(path)):
        found = with_retries(arg, "list", lambda: fs.find(path))
    else:
        found = [path] if with_retries(arg, "stat", lambda: fs.exists(path)) else []
    # prefixes holding mmpack's marker are packed datasets or work folders, never raw input
    marked = tuple(p[: -len(MARKER_NAME)] for p in found if p.endswith(f"/{MARKER_NAME}"))
    return sorted(as_url(p) for p in found if p.endswith(suffixes) and not p.startswith(marked))


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
        self, url: str, size: int, block_bytes: int = HEADER_BLOCK_BYTES, max_blocks: int | None = None
    ):
        super().__init__()
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
            data = read_range(self.name, lo, hi)
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


def open_ranged(url: str, block_bytes: int = HEADER_BLOCK_BYTES) -> RangedFile:
    """A `RangedFile` over a remote object (its size from the `identity` just taken, else one stat);
    FileNotFoundError if it does not exist."""
    size = _JUST_STATED.pop(url, None)
    return RangedFile(url, size if size is not None else int(info(url)["size"]), block_bytes)


STREAM_BLOCK_BYTES = 8 << 20


def open_binary(path: str) -> IO[bytes]:
    """A local file or a remote object opened for sequential or seeking binary reads (remote: 8 MiB ranged
    reads with retries, two blocks kept)."""
    if not is_url(path):
        from mmpack.packing.fileio import open_regular

        return open_regular(local_path(path))
    raw = RangedFile(path, int(info(path)["size"]), STREAM_BLOCK_BYTES, max_blocks=2)
    return io.BufferedReader(raw, buffer_size=1 << 20)
