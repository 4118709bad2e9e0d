"""Which folders are mmpack's to write into and delete from: the one owner of that rule.

Every folder mmpack creates for a user (a packed dataset, a job's work folder, a checkpoint folder, an HF
export) carries a marker file of its own, `.mmpack-owner.json`::

    {"kind": "dataset", "creator": "mmpack 0.1.0", "host": "node-3", "pid": 4242, "created": "2025-...Z"}

`claim_folder(url, kind)` is how a command takes a folder (a local path or an fsspec URL such as
`s3://bucket/prefix`) before it writes anything there:

- missing or empty: created (local folders) and marked with `kind`;
- marked with the same `kind`: reused as it is (a rerun, a resume);
- marked with another kind, or not empty and unmarked: `FolderNotOwned`, one line saying what to do.
  `overwrite=True` (the command's `--overwrite`, where it has one) adopts an unmarked folder: the marker is
  written and the command may replace the files it writes there; nothing else in it is touched.

Deleting goes only through an `OwnedFolder`, so it needs the marker, and touches only what the caller names:
`remove_recorded(paths)` deletes exactly the listed files (relative paths inside the folder), never a folder
recursively; `release()` then removes the marker, and the folder itself when nothing else is left (a local
`rmdir`; an object store has no folder, and a bucket is never deleted). Files the caller does not name stay.

Example (a command writing a checkpoint folder)::

    from mmpack.packing.ownership import FolderNotOwned, claim_folder

    folder = claim_folder(args.save, "checkpoint", overwrite=args.overwrite, overwrite_flag="--overwrite",
                          role="checkpoint folder (--save)")
    ...  # write files under folder.path("iter_0000100/...")
    folder.remove_recorded(["iter_0000050/model.pt"])  # only files this command recorded as its own
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import posixpath
import socket
from collections.abc import Iterable
from typing import Any

from mmpack.packing.errors import MmpackError
from mmpack.packing.fileio import atomic_write_bytes, json_bytes, resolve_storage_options

MARKER_NAME = ".mmpack-owner.json"
KINDS = ("dataset", "work", "checkpoint", "hf-export")


class FolderNotOwned(MmpackError):
    """A folder mmpack may not write into or delete from (not empty and unmarked, or another kind's)."""

    default_reason = "folder_not_owned"


def is_local(url: str) -> bool:
    """True for a local path or a `file://` URL."""
    return "://" not in url or url.startswith("file://")


def _local(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


class OwnedFolder:
    """A folder that carries mmpack's marker of `kind`: what a command may write into and delete from.

    Made by `claim_folder` or `open_owned` only. `url` is the folder as given (a local path or a URL);
    `created` is True when this claim wrote the marker (the folder was missing, empty, or adopted with
    `overwrite`): files already there then are not mmpack's, whatever their names.
    """

    def __init__(
        self, url: str, kind: str, marker: dict[str, Any], fs: Any, root: str, *, created: bool = False
    ) -> None:
        self.url = url
        self.kind = kind
        self.marker = marker
        self.created = created
        self._fs = fs  # None for a local folder
        self._root = root  # the local path, or the path inside the filesystem

    @property
    def is_local(self) -> bool:
        return self._fs is None

    def path(self, rel: str) -> str:
        """The local path or URL of `rel` inside the folder; ValueError if `rel` would leave it."""
        rel = _checked_rel(rel, self.url)
        if self._fs is None:
            return os.path.join(self._root, *rel.split("/"))
        return f"{self.url.rstrip('/')}/{rel}"

    def files(self) -> list[str]:
        """Relative paths ("a/b.json") of every file in the folder but the marker, sorted."""
        if self._fs is None:
            found = []
            for dirpath, _, names in os.walk(self._root):
                rel_dir = os.path.relpath(dirpath, self._root)
                for name in names:
                    rel = name if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{name}"
                    found.append(rel)
        else:
            base = self._root.rstrip("/")
            found = [p[len(base) + 1 :] for p in _find(self._fs, base) if p.startswith(base + "/")]
        return sorted(f for f in found if f != MARKER_NAME)

    def remove_recorded(self, rels: Iterable[str]) -> list[str]:
        """Delete exactly the listed files (relative paths); returns those that existed and are gone.

        A listed path that is a local folder is removed only if it is empty; the marker cannot be listed (see
        `release`). Local folders left empty by the removals are removed too, up to (not including) the root.
        """
        wanted = list(dict.fromkeys(_checked_rel(rel, self.url) for rel in rels))
        if MARKER_NAME in wanted:
            raise ValueError(f"{self.url}: the marker {MARKER_NAME} is removed by release(), not listed")
        if self._fs is not None:  # one listing and one bulk delete, not a request per file
            present = set(self.files())
            removed = [rel for rel in wanted if rel in present]
            if removed:
                self._fs.rm([f"{self._root}/{rel}" for rel in removed])
                self._fs.invalidate_cache(self._root)
            return removed
        removed = [rel for rel in wanted if self._remove_one(rel)]
        self._prune_empty_dirs({posixpath.dirname(r) for r in removed} - {""})
        return removed

    def release(self) -> bool:
        """Remove the marker, and the folder itself, if nothing else is left in it; returns True if so."""
        if self.files() or (self._fs is None and _has_subfolders(self._root)):
            return False
        self._remove_one(MARKER_NAME)
        if self._fs is None:
            with contextlib.suppress(FileNotFoundError, OSError):
                os.rmdir(self._root)  # never recursive: a file that appeared meanwhile keeps the folder
        return True

    def _remove_one(self, rel: str) -> bool:
        if self._fs is None:
            path = os.path.join(self._root, *rel.split("/"))
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)  # OSError if not empty: never recursive
                else:
                    os.unlink(path)
            except FileNotFoundError:
                return False
            return True
        target = f"{self._root.rstrip('/')}/{rel}"
        try:
            self._fs.rm_file(target)
        except FileNotFoundError:
            return False
        return True

    def _prune_empty_dirs(self, rel_dirs: set[str]) -> None:
        for rel in sorted(rel_dirs, key=lambda d: -d.count("/")):
            while rel:
                path = os.path.join(self._root, *rel.split("/"))
                try:
                    os.rmdir(path)
                except OSError:  # not empty (or gone): its parents are not empty either
                    break
                rel = posixpath.dirname(rel)


def claim_folder(
    url: str,
    kind: str,
    *,
    overwrite: bool = False,
    overwrite_flag: str | None = None,
    storage_options: dict[str, Any] | None = None,
    role: str | None = None,
    creator: str | None = None,
    replaces: str | None = None,
) -> OwnedFolder:
    """Take the folder `url` for writing `kind` (one of `KINDS`); see the module docstring for the rule.

    Args:
        overwrite: adopt a non-empty folder without a marker (the user asked for it).
        overwrite_flag: the command's flag for `overwrite`, named in the refusal (None: the command has none).
        storage_options: fsspec options of a URL (an S3 endpoint, credentials).
        role: how the command calls the folder in messages ("output (-o)"); default "folder".
        creator: the marker's "creator" (default "mmpack <version>").
        replaces: what `overwrite` replaces or deletes of a folder's files, for the refusal (default: the
            files of the names the command writes).

    Raises:
        FolderNotOwned: not empty and unmarked (without `overwrite`), marked with another kind, or a file.
    """
    fs, root, marker = _check_claim(url, kind, overwrite, overwrite_flag, storage_options, role, replaces)
    if marker is not None:
        return OwnedFolder(url, kind, marker, fs, root)
    marker = _new_marker(kind, creator)
    _write_marker(fs, root, marker)
    return OwnedFolder(url, kind, marker, fs, root, created=True)


def check_claim(
    url: str,
    kind: str,
    *,
    overwrite: bool = False,
    overwrite_flag: str | None = None,
    storage_options: dict[str, Any] | None = None,
    role: str | None = None,
    replaces: str | None = None,
) -> None:
    """Raises `FolderNotOwned` where `claim_folder` with the same arguments would, and writes nothing: a
    command checks its folders first, then its inputs, and claims (marks) the folders last."""
    _check_claim(url, kind, overwrite, overwrite_flag, storage_options, role, replaces)


def _check_claim(
    url: str,
    kind: str,
    overwrite: bool,
    overwrite_flag: str | None,
    storage_options: dict[str, Any] | None,
    role: str | None,
    replaces: str | None,
) -> tuple[Any, str, dict[str, Any] | None]:
    """(filesystem, root, the folder's marker of `kind` or None when it may be claimed); the checks both
    `check_claim` and `claim_folder` make."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    fs, root = _filesystem(url, storage_options)
    marker = _claimable(fs, root, f"{role or 'folder'} {url}", kind, overwrite, overwrite_flag, replaces)
    return fs, root, marker


def _claimable(
    fs: Any,
    root: str,
    what: str,
    kind: str,
    overwrite: bool,
    overwrite_flag: str | None,
    replaces: str | None,
) -> dict[str, Any] | None:
    """The folder's marker of `kind` (reuse it), or None when the folder may be claimed; FolderNotOwned else."""
    marker = _read_marker(fs, root)
    if marker is not None:
        if marker.get("kind") != kind:
            raise FolderNotOwned(
                f"{what} is mmpack's {marker.get('kind')!r} folder, not a {kind!r} one; choose another folder"
            )
        return marker
    if _is_file(fs, root):
        raise FolderNotOwned(f"{what} is a file, not a folder; choose a folder")
    if _first_entry(fs, root) is not None and not overwrite:
        how = ""
        if overwrite_flag:
            effect = replaces or "files there of the names the command writes are replaced"
            how = f", or pass {overwrite_flag} to let mmpack write there ({effect}; nothing else is touched)"
        raise FolderNotOwned(
            f"{what} is not empty and was not made by mmpack (it has no {MARKER_NAME}); choose an empty or new "
            f"folder{how}"
        )
    return None


def open_owned(url: str, kind: str, *, storage_options: dict[str, Any] | None = None) -> OwnedFolder:
    """The existing folder `url` if it carries the marker of `kind` (nothing is created or written).

    Raises:
        FolderNotOwned: no marker, or the marker of another kind.
    """
    fs, root = _filesystem(url, storage_options)
    marker = _read_marker(fs, root)
    if marker is None or marker.get("kind") != kind:
        found = "has no marker" if marker is None else f"is marked {marker.get('kind')!r}"
        raise FolderNotOwned(
            f"{url} {found}, not mmpack's {kind!r} marker {MARKER_NAME}: mmpack does not delete or change it"
        )
    return OwnedFolder(url, kind, marker, fs, root)


def read_marker(url: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The marker of the folder `url` (a dict with "kind", "creator", ...), or None when it has none."""
    fs, root = _filesystem(url, storage_options)
    return _read_marker(fs, root)


def has_marker(local_dir: str | os.PathLike[str]) -> bool:
    """True when the local folder carries mmpack's marker (of any kind): one `stat`."""
    return os.path.isfile(os.path.join(os.fspath(local_dir), MARKER_NAME))


def _checked_rel(rel: str, url: str) -> str:
    clean = posixpath.normpath(rel.replace("\\", "/")) if rel else ""
    if not rel or os.path.isabs(rel) or "://" in rel or clean in (".", "") or clean.split("/")[0] == "..":
        raise ValueError(f"{url}: {rel!r} is not a relative path inside the folder")
    return clean


def _filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """(fsspec filesystem or None for a local folder, root path)."""
    if is_local(url):
        return None, os.path.abspath(os.path.expanduser(_local(url)))
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(url, **resolve_storage_options(url, storage_options))
    return fs, root.rstrip("/")


def _read_marker(fs: Any, root: str) -> dict[str, Any] | None:
    try:
        if fs is None:
            with open(os.path.join(root, MARKER_NAME), "rb") as f:
                data = f.read()
        else:
            data = fs.cat_file(f"{root}/{MARKER_NAME}")
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        marker = json.loads(data)
    except ValueError:
        marker = None
    if not isinstance(marker, dict) or marker.get("kind") not in KINDS:
        raise FolderNotOwned(
            f"{root}: {MARKER_NAME} is not a marker mmpack wrote; remove it or choose another folder"
        )
    return marker


def _write_marker(fs: Any, root: str, marker: dict[str, Any]) -> None:
    data = json_bytes(marker)
    if fs is None:
        os.makedirs(root, exist_ok=True)
        atomic_write_bytes(os.path.join(root, MARKER_NAME), data)
    else:
        fs.pipe_file(f"{root}/{MARKER_NAME}", data)


def _new_marker(kind: str, creator: str | None) -> dict[str, Any]:
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    return {
        "kind": kind,
        "creator": creator or f"mmpack {_version()}",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "created": now.isoformat().replace("+00:00", "Z"),
    }


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("mmpack")
    except metadata.PackageNotFoundError:
        return "unknown"


def _is_file(fs: Any, root: str) -> bool:
    if fs is None:
        return os.path.exists(root) and not os.path.isdir(root)
    try:
        return bool(fs.isfile(root))
    except (FileNotFoundError, OSError):
        return False


def _first_entry(fs: Any, root: str) -> str | None:
    """Some entry of the folder (None: missing or empty)."""
    if fs is None:
        try:
            with os.scandir(root) as it:
                return next((e.name for e in it), None)
        except FileNotFoundError:
            return None
    try:
        fs.invalidate_cache(root)
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return None
    return next((str(e) for e in entries), None)


def _find(fs: Any, root: str) -> list[str]:
    try:
        fs.invalidate_cache(root)
        return [str(p) for p in fs.find(root)]
    except FileNotFoundError:
        return []


def _has_subfolders(root: str) -> bool:
    try:
        with os.scandir(root) as it:
            return any(e.is_dir(follow_symlinks=False) for e in it)
    except FileNotFoundError:
        return False
