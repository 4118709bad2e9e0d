"""Stage fingerprints: what a stage's outputs are a function of, so a rerun redoes exactly the stale work.

fingerprint(stage) = hash(stage name, its whole frozen config, the fingerprint of the stage before it, the
identity of every file it reads). Identity is (canonical absolute path, size, mtime_ns), or with
`--verify-inputs sha256` (canonical absolute path, size, sha256 of the content). The scan stage learns the
image files it reads while it runs: it records their identities per chunk, and its output fingerprint (the
one the next stage builds on) adds them, so an edited image redoes scan and everything after it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from mmpack.offline_packing.config import StageConfig
from mmpack.offline_packing.inputs.remote import RemoteFiles, is_url
from mmpack.packing.fileio import open_regular

FileIdentity = list  # [canonical path, size, mtime_ns or sha256]


def digest(*parts: Any) -> str:
    """A short stable hash of JSON-able parts."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def file_identity(remote: RemoteFiles, path: str, verify: str) -> FileIdentity:
    """(canonical path, size, mtime_ns) of a local file, or (canonical path, size, sha256) with verify="sha256".

    A missing file has identity (path, None, None): it differs from any existing file's. A remote input
    (URL) has identity (URL, size, ETag or mtime from the object store), see `RemoteFiles.identity`.
    """
    if is_url(path):
        return remote.identity(path, verify)
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return [real, None, None]
    if not stat.S_ISREG(st.st_mode):  # a FIFO or device is never read (the scan rejects it)
        return [real, None, None]
    if verify == "sha256":
        return [real, st.st_size, _sha256_of_file(real)]
    return [real, st.st_size, st.st_mtime_ns]


def _sha256_of_file(path: str) -> str:
    h = hashlib.sha256()

    with open_regular(path) as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def identities(remote: RemoteFiles, paths: Iterable[str], verify: str) -> list[FileIdentity]:
    return [file_identity(remote, p, verify) for p in paths]


def stage_fingerprint(
    stage: str, config: StageConfig, previous: str, inputs: Iterable[FileIdentity] = ()
) -> str:
    """The fingerprint of `stage` run with `config` after a stage with fingerprint `previous`."""
    return digest(stage, asdict(config), previous, list(inputs))
