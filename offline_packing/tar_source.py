"""WebDataset tars as raw input: each sample (members sharing a key) is one record.

A sample's `.json` member is the raw record (LLaVA, ShareGPT, caption, text-only); without one, a `.txt`
member plus one image member make a caption record. The record's image entries name members of the same
sample: by full member name ("000123.jpg"), by suffix after the key ("jpg", "img0.png"), or, when the
record has no image field at all, every image member of the sample in name order. Images never leave the
tar: they are addressed as `tar::<tar path>::<offset>::<size>` references, created here only (a record
cannot forge one: image strings from records are always resolved as members or file paths, never parsed).
The "line" of a tar record is its 1-based sample index in the tar.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmpack.offline_packing.inputs.remote import RemoteFiles, is_url
from mmpack.packing.fileio import open_regular
from mmpack.packing.tar_index import index_tar as walk_tar

if TYPE_CHECKING:
    from mmpack.offline_packing.context import JobContext

IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
_REF_PREFIX = "tar::"


@dataclass(frozen=True)
class TarSample:
    """One sample of a tar: its key and member suffix -> (data offset, size)."""

    key: str
    members: dict[str, tuple[int, int]]


def _split_name(name: str) -> tuple[str, str]:
    """WebDataset key/suffix split: the key ends at the first dot of the basename."""
    dirname, _, base = name.rpartition("/")
    stem, dot, suffix = base.partition(".")
    return (f"{dirname}/{stem}" if dirname else stem), suffix if dot else ""


def index_tar(ctx: JobContext, path: str) -> tuple[TarSample, ...]:
    """The samples of a tar, in member order (headers only; data is skipped by seeking). `path` may be a URL.
    Kept in the job's caches by identity (a rewritten tar is indexed again)."""
    if is_url(path):
        _, size, version = ctx.remote.identity(path, "stat")
    else:
        st = os.stat(path)
        size, version = st.st_size, st.st_mtime_ns
    return ctx.caches.get("tar_index", (path, size, version), lambda: _index_tar(ctx.remote, path), maxsize=2)


def _index_tar(remote: RemoteFiles, path: str) -> tuple[TarSample, ...]:
    samples: list[TarSample] = []
    with remote.open_binary(path) as f:
        entries = walk_tar(f, label=path, non_regular="skip")
    for name, offset, size in entries:
        key, suffix = _split_name(name)
        if key.startswith("__") or not suffix:
            continue
        if not samples or samples[-1].key != key:
            samples.append(TarSample(key, {}))
        samples[-1].members[suffix] = (offset, size)
    return tuple(samples)


def member_ref(tar_path: str, offset: int, size: int) -> str:
    where = tar_path if "://" in tar_path else os.path.abspath(tar_path)
    return f"{_REF_PREFIX}{where}::{offset}::{size}"


def is_member_ref(path: str) -> bool:
    return path.startswith(_REF_PREFIX)


def read_image_bytes(remote: RemoteFiles, path: str) -> bytes:
    """Bytes of an image file or of a tar member reference (remote ones by ranged reads with retries)."""
    if is_member_ref(path):
        tar_path, offset, size = path[len(_REF_PREFIX) :].rsplit("::", 2)
        if is_url(tar_path):
            return remote.read_range(tar_path, int(offset), int(offset) + int(size))
        with open_regular(tar_path) as f:
            f.seek(int(offset))
            data = f.read(int(size))
        if len(data) != int(size):
            raise OSError(f"tar member at {offset} of {tar_path} is truncated")
        return data
    if is_url(path):
        return remote.read_all(path)
    with open_regular(path) as f:
        return f.read()


def sample_record(remote: RemoteFiles, tar_path: str, sample: TarSample) -> dict:
    """The raw record of a tar sample (ValueError if it has none or its JSON is invalid)."""
    if "json" in sample.members:
        obj = json.loads(read_image_bytes(remote, member_ref(tar_path, *sample.members["json"])))
        if isinstance(obj, dict) and not any(k in obj for k in ("image", "images")):
            images = sorted(s for s in sample.members if s.rsplit(".", 1)[-1].lower() in IMAGE_SUFFIXES)
            if images:
                obj = {**obj, "images": images}
        return obj
    images = [s for s in sample.members if s.rsplit(".", 1)[-1].lower() in IMAGE_SUFFIXES]
    if "txt" in sample.members and len(images) == 1:
        text = read_image_bytes(remote, member_ref(tar_path, *sample.members["txt"])).decode("utf-8")
        return {"id": sample.key, "caption": text, "image": images[0]}
    raise ValueError(f"sample {sample.key!r} has no .json record (nor a .txt caption with one image)")


def resolve_member(image: str, tar_path: str, sample: TarSample) -> str:
    """The member reference an image entry of a tar record names; FileNotFoundError if none."""
    base = sample.key.rpartition("/")[2]
    for candidate in (image, image.removeprefix(f"{base}."), image.removeprefix(f"{sample.key}.")):
        if candidate in sample.members:
            return member_ref(tar_path, *sample.members[candidate])
    raise FileNotFoundError(f"sample {sample.key!r} of {tar_path} has no member {image!r}")
