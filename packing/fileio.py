"""The project's one atomic local write, its one S3 endpoint resolution, and its one way to open a local input
file without ever blocking on a FIFO or a device (stdlib only).

Used by the offline job (work folder, output store, inputs) and the loader (cache records, tar indexes) alike.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """A binary file that appears at `path` (parents created) only once the block completes without error.

    Written to a hidden sibling `.<name>.tmp-<pid>-<thread>` and renamed, so readers see all of it or nothing
    and several threads or processes may write the same path at once (the last rename wins).
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            yield f
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Writes `data` to `path` atomically (see `atomic_open`)."""
    with atomic_open(path) as f:
        f.write(data)


def json_bytes(obj: Any, *, indent: int | None = 1) -> bytes:
    """Deterministic JSON bytes: sorted keys, UTF-8 kept as is, a final newline (`indent=None`: compact)."""
    separators = (",", ":") if indent is None else None
    text = json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False, separators=separators)
    return (text + "\n").encode()


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 1) -> None:
    """Writes `obj` as deterministic JSON (see `json_bytes`) to `path`, atomically."""
    atomic_write_bytes(path, json_bytes(obj, indent=indent))


def resolve_storage_options(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """fsspec options for `url`; for s3:// the endpoint comes from `endpoint_url`, `client_kwargs`, or
    else $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL (in that order)."""
    opts = dict(storage_options or {})
    if url.startswith(("s3://", "s3a://")):
        client_kwargs = dict(opts.get("client_kwargs") or {})
        endpoint = opts.pop("endpoint_url", None) or client_kwargs.get("endpoint_url")
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            client_kwargs["endpoint_url"] = endpoint
            opts["client_kwargs"] = client_kwargs
    return opts


class NotRegularFileError(OSError):
    """A path that is a FIFO, socket, device or folder where a regular file was expected (never read)."""


def describe_mode(mode: int) -> str:
    """ "a FIFO (named pipe)", "a socket", "a character device", ... for a `stat` mode."""
    kinds = (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
    )
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike[str]) -> IO[bytes]:
    """`path` opened for binary reads if it is a regular file (symlinks followed); else NotRegularFileError.

    Opened without blocking and checked on the open descriptor, so a FIFO (whose open would wait for a writer
    forever), a socket or a device is refused without a hang, and a file swapped in between is not missed.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ENXIO and os.path.exists(path):  # a socket (or a FIFO-like device)
            what = describe_mode(os.stat(path).st_mode)
            raise NotRegularFileError(f"{os.fspath(path)} is {what}, not a regular file") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFileError(f"{os.fspath(path)} is {describe_mode(mode)}, not a regular file")
    os.set_blocking(fd, True)
    f = os.fdopen(fd, "rb")
    f.raw.name = os.fspath(path)  # type: ignore[attr-defined]  # messages name the path, not the descriptor
    return f
