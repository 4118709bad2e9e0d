"""The output folder: a local path or an fsspec URL (s3://...), written atomically file by file.

Local: each file is written to a hidden temporary sibling and renamed into place. Object stores: the file
is built in a local staging folder and uploaded in one put, so a reader never sees a partial object.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from mmpack.packing.fileio import atomic_open, resolve_storage_options


class OutputStore:
    """Files under the output root `url`, addressed by relative paths ("shards/x.tar")."""

    def __init__(self, url: str, storage_options: dict | None = None, staging_dir: str | Path | None = None):
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **resolve_storage_options(url, storage_options))
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.staging_dir = Path(staging_dir) if staging_dir is not None else None

    def full_path(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}"

    def local_path(self, rel: str) -> Path:
        """Path of `rel` on local disk (local outputs only)."""
        if not self.is_local:
            raise ValueError(f"{self.url} is not a local folder")
        return Path(self.full_path(rel))

    @contextmanager
    def open_atomic(self, rel: str) -> Iterator[IO[bytes]]:
        """A binary file that appears under `rel` only once the block completes without error."""
        if self.is_local:
            with atomic_open(self.local_path(rel)) as f:
                yield f
            return
        if self.staging_dir is None:
            raise ValueError("a staging folder is needed to write to an object store")
        with atomic_open(self.staging_dir / rel.replace("/", "__")) as f:
            yield f
        staged = self.staging_dir / rel.replace("/", "__")
        try:
            self.fs.put_file(str(staged), self.full_path(rel))
        finally:
            staged.unlink(missing_ok=True)

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self.open_atomic(rel) as f:
            f.write(data)

    def size(self, rel: str) -> int | None:
        """Size in bytes of `rel`, or None if it does not exist."""
        try:
            if self.is_local:
                return self.local_path(rel).stat().st_size
            info: Any = self.fs.info(self.full_path(rel))
            return int(info["size"])
        except (FileNotFoundError, OSError):
            return None

    def remove(self, rel: str) -> None:
        if self.size(rel) is not None:
            self.fs.rm(self.full_path(rel))

    def clean_temporaries(self, rel_dir: str) -> None:
        """Remove temporary files left by a killed job in a local folder."""
        if not self.is_local:
            return
        d = self.local_path(rel_dir)
        if d.is_dir():
            for p in d.glob(".*.tmp-*"):
                p.unlink(missing_ok=True)
