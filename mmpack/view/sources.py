"""The dataset `mmpack view` shows, as a local folder: a local dataset as it is; a dataset in object storage or
over HTTP, or a mixture of datasets (a mixture file of the loader, `mmpack.dataloader.mixture`), as a folder of
links (`DIR/_dataset/`) to shards the loader's shard store fetched and checked against their sha256 (its cache,
shared with training), so that the rest of the view reads one local dataset.

A mixture's folder holds each source's shards under `src<k>/` beside that source's own `manifest.json`, and a
manifest of all of them in order (the first source's, its shards those of every source, its counts their sums):
bin numbers run through the sources in the mixture's order, and each source's bins are decoded by its own
image rule."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmpack.dataloader.manifest import Manifest, join_url, load_manifest
from mmpack.dataloader.mixture import check_sources, load_mixture_file, vision_source
from mmpack.dataloader.storage import ShardStore, StorageConfig
from mmpack.packing.format import MANIFEST_NAME
from mmpack.packing.manifest import ManifestCounts, ShardEntry

MIXTURE_SUFFIXES = (".yaml", ".yml", ".json")
MAX_REJECTS_BYTES = 4 << 20  # of a remote rejects.jsonl: the page lists only its first rejects
LOCAL_NAME = "_dataset"  # the local folder of a remote dataset or a mixture, inside the report's folder


@dataclass(frozen=True)
class ViewSource:
    """One source of a mixture as the page shows it: its name, where it is, its share and its bins."""

    name: str
    path: str
    folder: str  # its folder in the local dataset (`src<k>`)
    weight: float | None
    repeat: float | None
    share: float
    first_bin: int
    bins: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class LocalDataset:
    """The local folder the view reads, how the page names it, a mixture's sources (empty for one dataset), and
    (local folder, shown instead) for the paths in problem lines."""

    root: Path
    label: str
    sources: tuple[ViewSource, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()

    def shown(self, line: str) -> str:
        """`line` with the local folders of remote datasets and sources named as the user named them."""
        for local, label in sorted(self.renames, key=lambda r: -len(r[0])):  # src10 before src1
            line = line.replace(local, label)
        return line


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def is_mixture_file(path: str) -> bool:
    """A local mixture file (YAML or JSON), not a dataset's manifest.json."""
    p = Path(path)
    return p.suffix in MIXTURE_SUFFIXES and p.name != MANIFEST_NAME and p.is_file()


def local_dataset(
    path: str,
    work: Path,
    *,
    storage_options: dict[str, Any] | None = None,
    shard_format: str | None = None,
    cache_dir: str | None = None,
    problems: list[str] | None = None,
    say: Callable[[str], None] = print,
) -> LocalDataset:
    """The dataset at `path` (a folder, its manifest.json, a URL or a mixture file) as a local folder; shards that
    cannot be fetched are left out of it, each one line in `problems`."""
    problems = [] if problems is None else problems
    if is_mixture_file(path):
        return _mixture(path, work / LOCAL_NAME, storage_options, shard_format, cache_dir, problems, say)
    if is_remote(path):
        root = path.rstrip("/").removesuffix("/" + MANIFEST_NAME)
        manifest = load_manifest(root, storage_options=storage_options, shard_format=shard_format)
        local = _fresh(work / LOCAL_NAME)
        say(
            f"mmpack view: fetching the {len(manifest.shards)} shards of {root} (checked, into the loader's cache)"
        )
        _link_remote(root, manifest, local, storage_options, cache_dir, problems)
        (local / MANIFEST_NAME).write_text(json.dumps(manifest.raw), encoding="utf-8")
        _copy_rejects(root, local / "rejects.jsonl", storage_options)
        return LocalDataset(local, root, renames=((str(local), root),))
    p = Path(path.removeprefix("file://"))
    if p.name == MANIFEST_NAME:
        p = p.parent
    if not (p / MANIFEST_NAME).is_file():
        raise FileNotFoundError(f"{p}: no manifest.json: not a packed dataset (for raw records give -n N)")
    return LocalDataset(p, str(p))


def _fresh(folder: Path) -> Path:
    """`folder`, emptied (it is the view's own: inside the report folder, which carries the view's marker)."""
    if folder.is_dir():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def _link_remote(
    root: str,
    manifest: Manifest,
    local: Path,
    options: dict[str, Any] | None,
    cache_dir: str | None,
    problems: list[str],
) -> None:
    """Link each shard of `manifest` into `local`, fetched (and checked) by the loader's shard store."""
    store = ShardStore(StorageConfig(root=root, storage_options=options, cache_dir=cache_dir, max_attempts=3))
    for entry in manifest.shards:
        try:
            cached = store.local_path(entry)
        except Exception as e:  # one shard: the others still show
            problems.append(
                f"shard {join_url(root, entry.path)} cannot be fetched: {' '.join(str(e).split())}"
            )
            continue
        _link(Path(cached), local / entry.path)


def _link(target: Path, link: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target.resolve(), link)


def _copy_rejects(root: str, dest: Path, options: dict[str, Any] | None) -> None:
    """The first lines of the dataset's rejects.jsonl (up to `MAX_REJECTS_BYTES`), where it has one."""
    if not is_remote(root):
        src = Path(root.removeprefix("file://")) / "rejects.jsonl"
        data = b""
        if src.is_file():
            with src.open("rb") as f:
                data = f.read(MAX_REJECTS_BYTES)
    else:
        from fsspec.core import url_to_fs

        from mmpack.packing.fileio import resolve_storage_options

        url = join_url(root, "rejects.jsonl")
        fs, fs_path = url_to_fs(url, **resolve_storage_options(url, options))
        try:
            with fs.open(fs_path, "rb") as f:
                data = f.read(MAX_REJECTS_BYTES)
        except FileNotFoundError:
            data = b""
    if len(data) == MAX_REJECTS_BYTES:
        data = data[: data.rfind(b"\n") + 1]  # whole lines only
    with dest.open("ab") as f:
        f.write(data)


def _mixture(
    path: str,
    folder: Path,
    options: dict[str, Any] | None,
    shard_format: str | None,
    cache_dir: str | None,
    problems: list[str],
    say: Callable[[str], None],
) -> LocalDataset:
    """A mixture file's sources in one local dataset (see the module docstring)."""
    try:
        mixture = load_mixture_file(path)
    except ValueError as e:  # a .json of raw records is no mixture either
        raise ValueError(f"{e} (for raw records give -n N)") from None
    names = mixture.names
    manifests = [
        load_manifest(s.path, storage_options=s.storage_options or options, shard_format=shard_format)
        for s in mixture.sources
    ]
    check_sources(names, manifests)
    shares = mixture.shares([m.num_bins for m in manifests])
    local = _fresh(folder)
    shards: list[ShardEntry] = []
    sources: list[ViewSource] = []
    first = 0
    for k, (s, name, m, share) in enumerate(zip(mixture.sources, names, manifests, shares)):
        sub = f"src{k}"
        (local / sub).mkdir()
        (local / sub / MANIFEST_NAME).write_text(json.dumps(m.raw), encoding="utf-8")
        if is_remote(s.path):
            say(f"mmpack view: fetching the {len(m.shards)} shards of source {name} ({s.path})")
            _link_remote(s.path, m, local / sub, s.storage_options or options, cache_dir, problems)
        else:
            for entry in m.shards:
                _link(Path(s.path.removeprefix("file://")) / entry.path, local / sub / entry.path)
        _copy_rejects(s.path, local / "rejects.jsonl", s.storage_options or options)
        shards += [
            dataclasses.replace(e, path=f"{sub}/{e.path}", first_bin=first + e.first_bin) for e in m.shards
        ]
        sources.append(ViewSource(name, s.path, sub, s.weight, s.repeat, share, first, m.num_bins))
        first += m.num_bins
    combined = dataclasses.replace(
        manifests[vision_source(manifests)].dataset,  # its image rule's geometry is every image source's
        shards=tuple(shards),
        formats=(shards[0].format,),
        counts=_summed([m.dataset.counts for m in manifests]),
    )
    (local / MANIFEST_NAME).write_bytes(combined.to_json())
    renames = tuple((str(local / s.folder), s.path.rstrip("/")) for s in sources)
    return LocalDataset(local, path, tuple(sources), renames)


def _summed(counts: list[ManifestCounts | None]) -> ManifestCounts | None:
    """The counts of all sources together (None where a source has none)."""
    if any(c is None for c in counts):
        return None
    total: dict[str, Any] = {}
    for c in counts:
        for key, value in c.to_dict().items():  # type: ignore[union-attr]
            if isinstance(value, dict):
                reasons = total.setdefault(key, {})
                for reason, n in value.items():
                    reasons[reason] = reasons.get(reason, 0) + n
            else:
                total[key] = total.get(key, 0) + value
    return ManifestCounts.from_dict(total, "mixture counts")


def source_of_bin(sources: tuple[ViewSource, ...], bin_id: int) -> int:
    """Index of the source holding global bin `bin_id` (0 for one dataset)."""
    for k, s in enumerate(sources):
        if s.first_bin <= bin_id < s.first_bin + s.bins:
            return k
    return 0
