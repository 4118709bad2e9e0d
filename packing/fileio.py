"""The project's one atomic local write and its one S3 endpoint resolution (stdlib only).

Used by the offline job (work folder, output store) and the loader (cache records, tar indexes) alike.
"""

from __future__ import annotations

import contextlib
import json
import os
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
