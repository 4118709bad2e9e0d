"""The job's work folder: per-chunk stage outputs, completion markers and atomic writes.

Every file is written to a temporary name and renamed, and a chunk's `.done.json` is written after its
outputs, so a killed job leaves either complete files or none, never a partial one under a final name.

The work folder is a local path (one machine, or a filesystem every node mounts) or an fsspec URL
(`s3://bucket/work`), which every node of a Ray cluster reaches without a shared filesystem. A URL work
folder is mirrored: stage code reads and writes local paths under a cache folder of the job's run
(`<tmp>/mmpack-work/<url digest>/<run>[-<node>]`, named by the job context); a file is fetched from the URL
the first time it is asked for (`WorkDir.file`), and every file written through `WorkDir.write_*` is
uploaded after its local rename, markers last as locally. Files do not change within a stage once written,
and each run starts with an empty cache, so a cached copy is never stale; the driver drops its copies of a
stage's files before running that stage (`WorkDir.forget`), which is the one time they change.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mmpack.offline_packing.config import STAGES
from mmpack.offline_packing.inputs.remote import is_url, local_path, with_retries
from mmpack.packing import fileio

if TYPE_CHECKING:
    from mmpack.offline_packing.context import JobContext


# The names of the files the job writes into a work folder (and of their temporaries, ".<name>.tmp-..." and
# ".<name>.fetch-..."): `--clean-work` deletes these and nothing else.
_STAGE_FILES = {
    "scan": r"chunk-\d{6}\.(samples\.jsonl|rejects\.jsonl|images\.json|done\.json)",
    "lengths": r"chunk-\d{6}\.(done\.json|[a-z_]+\.npy|samples\.jsonl|rejects\.jsonl)",
    "binpack": r"[a-z_]+\.npy",
    # shard markers, the write record, and files staged for an object-store output ("shards__x.tar")
    "write": r"shard-\d{6}\.json|written\.json|manifest\.json|rejects\.jsonl|stats\.json|"
    r"shards__[A-Za-z0-9_-]+-\d{6}\.(arrow|tar)",
}
_TEMPORARY = r"(\.(tmp|fetch)-[0-9a-f-]+)?"  # atomic writes and fetches go through hidden siblings
_WORK_FILE = re.compile(
    "^("
    + "|".join(
        [rf"\.?{stage}\.done\.json{_TEMPORARY}" for stage in STAGES]
        + [rf"{stage}/\.?({names}){_TEMPORARY}" for stage, names in _STAGE_FILES.items()]
    )
    + ")$"
)


def is_work_file(rel: str) -> bool:
    """True for a path (relative to the work folder) of a file the job writes there."""
    return _WORK_FILE.match(rel) is not None


def cache_root(url: str, run: str, node: str = "") -> Path:
    """The local cache of work folder `url` in run `run` on node `node`."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "mmpack-work" / digest / (run + (f"-{node}" if node else ""))


def drop_other_caches(url: str, run: str) -> None:
    """Remove this machine's caches of `url` left by runs other than `run` (a run removes its own when it
    ends)."""
    parent = cache_root(url, run).parent
    if parent.is_dir():
        for d in parent.iterdir():
            if d.name.split("-")[0] != run:
                shutil.rmtree(d, ignore_errors=True)


def npy_bytes(arr: np.ndarray) -> bytes:
    """The bytes of `arr` as a C-order .npy file (no pickled objects)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def jsonl_line(row: dict) -> bytes:
    """One compact sorted-key JSON object and its newline (deterministic bytes)."""
    return (json.dumps(row, ensure_ascii=False, sort_keys=True, separators=(",", ":")) + "\n").encode()


def read_done_marker(path: Path, fingerprint: str) -> dict | None:
    """The completion marker at `path` if it records `fingerprint` (same options as now), else None."""
    if not path.is_file():
        return None
    marker = read_json(path)
    return marker if marker.get("fingerprint") == fingerprint else None


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class WorkDir:
    """Layout of the work folder: `<root>/<stage>/...` plus `<root>/<stage>.done.json` markers.

    `address` is what the job was given (a local path or a URL); the job context carries it, so a Ray worker
    on another node opens the same work folder. `root` is the local folder the stage code reads and writes:
    the address itself, or the run's cache of the URL on this node (earlier runs' caches are removed when a
    process first opens it).
    """

    def __init__(self, ctx: JobContext):
        self.address = ctx.work_dir
        self.url: str | None = None
        self._remote = ctx.remote
        if is_url(self.address):
            self.url = self.address.rstrip("/")
            self.root = cache_root(self.url, ctx.run_id, ctx.node)
            drop_other_caches(self.url, ctx.run_id)
        else:
            self.root = Path(local_path(self.address))

    def stage_dir(self, stage: str) -> Path:
        """The local folder of `stage` (created); its files are fetched one by one with `file`."""
        d = self.root / stage
        d.mkdir(parents=True, exist_ok=True)
        return d

    def file(self, rel: str) -> Path:
        """The local path of `rel` (under the work folder), fetched from the URL first if not here yet;
        a file the URL does not have either is simply absent."""
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.url is None or path.exists():
            return path
        fs, root = self._remote.filesystem(self.url)
        tmp = path.with_name(f".{path.name}.fetch-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            with_retries(f"{self.url}/{rel}", "fetch", lambda: fs.get_file(f"{root}/{rel}", str(tmp)))
            os.replace(tmp, path)
        except FileNotFoundError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def stage_file(self, stage: str, name: str) -> Path:
        return self.file(f"{stage}/{name}")

    def chunk_path(self, stage: str, chunk: int, suffix: str) -> Path:
        return self.file(f"{stage}/chunk-{chunk:06d}.{suffix}")

    def marker(self, stage: str) -> Path:
        return self.file(f"{stage}.done.json")

    # -- writes: atomic locally (`mmpack.packing.fileio`), then uploaded to a URL work folder ---------------
    def write_bytes(self, path: str | os.PathLike[str], data: bytes) -> None:
        """Writes `data` to `path` (under `root`) atomically, then to the work folder URL."""
        fileio.atomic_write_bytes(path, data)
        self._publish(Path(path))

    def write_json(self, path: str | os.PathLike[str], obj: Any, *, indent: int | None = 1) -> None:
        """Writes `obj` as deterministic JSON (see `write_bytes`)."""
        self.write_bytes(path, fileio.json_bytes(obj, indent=indent))

    def write_npy(self, path: Path, arr: np.ndarray) -> None:
        """Writes `arr` as a .npy file (see `write_bytes`)."""
        self.write_bytes(path, npy_bytes(arr))

    def write_jsonl(self, path: Path, rows: Iterable[dict]) -> int:
        """Writes one compact sorted-key JSON object per line, each as it comes (memory holds one row), then
        to the URL; returns the number of rows."""
        n = 0
        with fileio.atomic_open(path) as f:
            for row in rows:
                f.write(jsonl_line(row))
                n += 1
        self._publish(path)
        return n

    def _publish(self, path: Path) -> None:
        """Upload a file just written under a URL work folder's cache to the URL."""
        if self.url is None:
            return
        rel = path.relative_to(self.root).as_posix()
        fs, root = self._remote.filesystem(self.url)
        target = f"{root.rstrip('/')}/{rel}"
        with_retries(f"{self.url}/{rel}", "upload", lambda: fs.put_file(str(path), target))

    def remove(self, rel_glob: str) -> None:
        """Delete the files matching `rel_glob` ("lengths/*.done.json", "scan.done.json") here and at the URL."""
        for p in self.root.glob(rel_glob):
            if p.is_file():
                p.unlink()
        if self.url is not None:
            fs, root = self._remote.filesystem(self.url)
            found = with_retries(self.url, "list", lambda: fs.glob(f"{root}/{rel_glob}"))
            if found:
                with_retries(self.url, "delete files of", lambda: fs.rm(found))

    def forget(self, stage: str) -> None:
        """Drop this process's cached copies of `stage`'s files (a URL work folder, before the stage runs:
        its files will change)."""
        if self.url is not None:
            shutil.rmtree(self.root / stage, ignore_errors=True)
            (self.root / f"{stage}.done.json").unlink(missing_ok=True)

    def close(self) -> None:
        """End of the job: a URL work folder's local cache is removed (the URL keeps everything)."""
        if self.url is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def is_done(self, stage: str, fingerprint: str) -> bool:
        """True when `stage` completed with the same options (fingerprint) as now."""
        return read_done_marker(self.marker(stage), fingerprint) is not None

    def mark_done(self, stage: str, fingerprint: str, info: dict) -> None:
        self.write_json(self.marker(stage), {"fingerprint": fingerprint, **info})

    def read_marker(self, stage: str) -> dict:
        return read_json(self.marker(stage))

    def clear_marker(self, stage: str) -> None:
        self.remove(f"{stage}.done.json")
