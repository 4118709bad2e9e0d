"""Raw input files: expansion of -i arguments, and image and video paths resolved under the image root.

Chunks of records are cut and read by `chunks`; JSON in the forms users write it (BOM, JSONL inside `.json`,
gzip, CRLF) is parsed by `json_records`.

Input files are canonical absolute paths, each read once however it was named (relative and absolute
paths, symlinks, a file also matched by a folder or glob). Inputs and the image root may also be fsspec URLs
(s3://, http(s)://; `mmpack.offline_packing.inputs.remote`): remote files are read with ranged reads and retries,
and `file://` URLs are the local paths they name.
"""

from __future__ import annotations

import glob
import itertools
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from mmpack.offline_packing.config import require_utf8_path
from mmpack.offline_packing.inputs.remote import RemoteFiles, is_url, join_under, local_path, parent
from mmpack.packing.fileio import NotRegularFileError, describe_mode
from mmpack.packing.ownership import MARKER_NAME, has_marker

INPUT_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet", ".tar")


def is_input_file(name: str) -> bool:
    """True for the file names the job reads (by suffix)."""
    return name.endswith(INPUT_SUFFIXES)


def expand_inputs(
    remote: RemoteFiles, inputs: tuple[str, ...] | list[str], exclude: tuple[str, ...] = ()
) -> list[str]:
    """Input files in a fixed order: each argument (file, folder, glob) expanded and sorted, in argument order.

    Paths come back absolute and normalised; a file named twice (relative and absolute path, a symlink,
    a file under a folder also given) is kept once, at its first place. Folders and globs never yield files
    under the folders of `exclude` (the job's output and work folder) nor under any folder that carries
    mmpack's marker (another packed dataset or work folder; a line on stderr names each folder so left out
    and its file count); a file named on its own under `exclude` is an
    error. Only regular files are read: a FIFO, socket or device named as an input is an error, and so is a path
    that is not valid UTF-8 (named as bytes).
    """
    skip = _Excluded(exclude)
    files: list[str] = []
    seen: set[str] = set()
    for arg in map(local_path, inputs):
        if is_url(arg):
            listed, marked = remote.expand(arg, INPUT_SUFFIXES)
            skip.count_marked(marked)
            found = [f for f in listed if not skip.url(f)]
            if not found:
                raise FileNotFoundError(f"input {arg!r} matches no {'/'.join(INPUT_SUFFIXES)} object")
            files += [f for f in found if f not in seen]
            seen.update(found)
            continue
        p = Path(arg).expanduser()
        if p.is_dir():
            found = sorted(str(f) for f in p.rglob("*") if f.is_file() and is_input_file(f.name))
            found = [f for f in found if not skip.local(f, str(p))]
        elif p.is_file() or (os.path.lexists(p) and not glob.has_magic(arg)):  # a FIFO too: refused below
            skip.refuse_named(str(p))
            found = [str(p)]
        else:
            found = sorted(f for f in glob.glob(str(p), recursive=True) if is_input_file(f))
            found = [f for f in found if not skip.local(f, _glob_base(str(p)))]
        if not found:
            raise FileNotFoundError(
                f"input {arg!r} matches no {'/'.join(INPUT_SUFFIXES)} file; check the -i path"
            )
        for f in found:
            real = os.path.realpath(f)
            if real not in seen:
                require_utf8_path(f, "input")
                _require_regular_file(f)
                seen.add(real)
                files.append(os.path.abspath(f))
    skip.report_marked()
    return files


class _Excluded:
    """Which files folder and glob expansion leaves out: the job's own folders and mmpack-marked ones."""

    def __init__(self, folders: tuple[str, ...]) -> None:
        self.urls = tuple(f.rstrip("/") + "/" for f in folders if is_url(f))
        self.local_dirs = tuple(os.path.realpath(local_path(f)) for f in folders if not is_url(f))
        self._marked: dict[str, bool] = {}
        self.skipped_marked: dict[str, int] = {}  # marked folder -> input files left out because of it

    def url(self, url: str) -> bool:
        return url.startswith(self.urls)

    def local(self, path: str, base: str) -> bool:
        """True if `path` (found under folder `base`) is in an excluded folder or a marked one below `base`."""
        real = os.path.realpath(path)
        if any(real == d or real.startswith(d + os.sep) for d in self.local_dirs):
            return True
        folders = _folders_between(os.path.abspath(base), os.path.abspath(path))
        marked = next((d for d in folders if self._has_marker(d)), None)
        if marked is not None:
            self.skipped_marked[marked] = self.skipped_marked.get(marked, 0) + 1
        return marked is not None

    def count_marked(self, skipped: dict[str, int]) -> None:
        """Counts the files a remote listing left out under marked prefixes (`RemoteFiles.expand`), but for
        the job's own output and work folder (left out without a word, as local ones are)."""
        for folder, n in skipped.items():
            if not self.url(folder + "/"):
                self.skipped_marked[folder] = self.skipped_marked.get(folder, 0) + n

    def report_marked(self) -> None:
        """One line on stderr per marked folder whose files were left out: never skipped without a word."""
        for folder, n in sorted(self.skipped_marked.items()):
            print(
                f"note: {n} input file(s) under {folder} skipped: it carries mmpack's marker {MARKER_NAME} (a "
                "packed dataset or work folder); name them with -i to read them, or remove the marker if the "
                "folder is not mmpack's",
                file=sys.stderr,
            )

    def refuse_named(self, path: str) -> None:
        real = os.path.realpath(path)
        for d in self.local_dirs:
            if real.startswith(d + os.sep):
                raise ValueError(
                    f"input {path} is inside this job's output or work folder {d}: mmpack never reads its own "
                    "files as input; move the input out or choose another -o / --work-dir"
                )

    def _has_marker(self, folder: str) -> bool:
        if folder not in self._marked:
            self._marked[folder] = has_marker(folder)
        return self._marked[folder]


def _folders_between(base: str, path: str) -> Iterator[str]:
    """The folders from `path`'s own folder up to `base` (inclusive)."""
    folder = os.path.dirname(path)
    while True:
        yield folder
        if folder == base or os.path.dirname(folder) == folder or not folder.startswith(base):
            return
        folder = os.path.dirname(folder)


def _glob_base(pattern: str) -> str:
    """The folder a glob pattern starts from: its longest leading part without wildcards."""
    parts = Path(pattern).parts
    fixed = list(itertools.takewhile(lambda part: not glob.has_magic(part), parts))
    return str(Path(*fixed)) if fixed else "."


def _require_regular_file(path: str) -> None:
    """Raises NotRegularFileError naming `path` unless it is a regular file (a FIFO would block the read)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"input {path} does not exist (a broken link?); check the -i path") from None
    if not stat.S_ISREG(mode):
        raise NotRegularFileError(
            f"input {path} is {describe_mode(mode)}, not a regular file; mmpack reads only regular files"
        )


def input_folder(path: str) -> str:
    """The folder of an input file (a URL's prefix up to its last slash): the default image root."""
    return parent(path) if is_url(path) else str(Path(path).parent)


def resolve_image_path(image: str, image_root: str) -> str:
    """The real path of `image` under `image_root` (a URL under a URL root).

    Raises:
        PermissionError: the path is absolute or escapes the root (`..`, symlinks pointing outside).
    """
    if not isinstance(image, str) or not image:
        raise PermissionError(f"image path must be a non-empty string, got {image!r}")
    if os.path.isabs(image) or image.startswith("~") or "\x00" in image:
        raise PermissionError(f"image path {image!r} is absolute; paths must be relative to the image root")
    image_root = local_path(image_root)
    if is_url(image_root):
        return join_under(image_root, image)
    root = os.path.realpath(image_root)
    full = os.path.realpath(os.path.join(root, image))
    if os.path.commonpath([root, full]) != root:
        raise PermissionError(f"image path {image!r} escapes the image root {image_root}")
    return full
