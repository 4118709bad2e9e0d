"""LLaVA-OneVision-2 codec-stream videos given as `cv-preinfer` output folders: where a record names a video,
it may name such a folder (resolved like a video path: a local folder, or a URL prefix read through the job's
`RemoteFiles`, whose meta.json must then list `canvas_files`) holding `meta.json` (`fps`, `canvas_files`, `patch`,
`block_size`), `src_patch_position.npy` and the canvases. The scan reads the folder's canvas headers, positions
and fps and records a summary (`read_codec_folder`); the write stage packs the kept canvases as read and their
block-ordered positions into one blob (`codec_blob`). The rules are `mmpack.packing.video_codec_ov2`'s.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from mmpack.offline_packing.inputs.remote import RemoteFiles, is_url
from mmpack.packing import video_codec_ov2 as codec
from mmpack.packing.fileio import open_regular
from mmpack.packing.image_tokens import read_image_size

META = "meta.json"
POSITIONS = "src_patch_position.npy"
CANVAS_FORMATS = ("jpg", "png")
MAX_META_BYTES = 64 << 20  # meta.json: a few hundred KB for 256 frames; past this it is no cv-preinfer output
MAX_CANVASES = 4096  # cv-preinfer writes at most a few dozen per video
DEFAULT_PATCH = 14  # cv-preinfer's default and LLaVA-OneVision-2's patch


@dataclass(frozen=True)
class AssetFiles:
    """How a codec video's files are read: local paths as regular files, URLs through `remote` (ranged reads
    with the job's retries)."""

    remote: RemoteFiles | None = None

    def open(self, path: str) -> IO[bytes]:
        if not is_url(path):
            return open_regular(path)
        if self.remote is None:
            raise OSError(f"{path}: a URL, read without the job's storage")
        return self.remote.open_ranged(path)  # type: ignore[return-value]

    def read_all(self, path: str) -> bytes:
        if not is_url(path):
            with open_regular(path) as f:
                return f.read()
        if self.remote is None:
            raise OSError(f"{path}: a URL, read without the job's storage")
        return self.remote.read_all(path)

    def size(self, path: str) -> int:
        if not is_url(path):
            return os.path.getsize(path)
        if self.remote is None:
            raise OSError(f"{path}: a URL, read without the job's storage")
        return int(self.remote.info(path)["size"])

    def join(self, folder: str, name: str) -> str:
        return folder.rstrip("/") + "/" + name if is_url(folder) else os.path.join(folder, name)


def is_codec_folder(path: str, files: AssetFiles | None = None) -> bool:
    """Whether a video path is a `cv-preinfer` output folder: a local folder holding its meta.json or
    positions, or a URL with no file extension under which a meta.json exists."""
    if not is_url(path):
        return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in (META, POSITIONS))
    last = path.rstrip("/").rsplit("/", 1)[-1]
    if files is None or files.remote is None or ("." in last and not path.endswith("/")):
        return False
    try:
        files.size(files.join(path, META))
    except FileNotFoundError:
        return False
    return True


def asset_files(folder: str, files: AssetFiles | None = None) -> list[str]:
    """The files of a codec folder the scan and the write stage read: meta.json, the positions, the canvases
    (CodecAssetError where meta.json is missing or unreadable, or names a canvas outside the folder)."""
    files = files or AssetFiles()
    meta = _read_meta(folder, files)
    return [files.join(folder, META), files.join(folder, POSITIONS)] + [
        files.join(folder, n) for n in _canvas_names(folder, meta)
    ]


def read_codec_folder(folder: str, *, name: str, files: AssetFiles | None = None) -> dict[str, Any]:
    """The scan's `video_info` of a codec folder: its summary (`video_codec_ov2.codec_summary`) under "codec"
    and the bytes the packed blob will hold; CodecAssetError naming `name` where the assets do not fit."""
    files = files or AssetFiles()
    checked, paths, _, patch = _checked(folder, name, files)
    summary = codec.codec_summary(checked, patch_size=patch)
    nbytes = sum(files.size(paths[k]) for k in checked.kept) + checked.positions.size * 4
    return {"codec": summary, "nbytes": int(nbytes)}


def codec_blob(folder: str, *, name: str, files: AssetFiles | None = None) -> bytes:
    """The packed form of a codec folder (`video_codec_ov2.pack_codec_blob`): the kept canvases as read and their
    block-ordered positions (checked again: the folder is read anew)."""
    files = files or AssetFiles()
    checked, paths, formats, _ = _checked(folder, name, files)
    data = [files.read_all(paths[k]) for k in checked.kept]
    return codec.pack_codec_blob(data, [formats[k] for k in checked.kept], checked.positions)


def read_codec_files(canvases: list[str], positions: str, fps: Any, *, name: str) -> dict[str, Any]:
    """`read_codec_folder` of LLaVA-OneVision-2's training form of the same assets: the canvas files (in model
    order), the row-major positions `.npy` and the fps of a record (patch 14, the model's)."""
    checked, _ = _check_files(canvases, positions, fps, DEFAULT_PATCH, name, AssetFiles())
    summary = codec.codec_summary(checked, patch_size=DEFAULT_PATCH)
    nbytes = sum(os.path.getsize(canvases[k]) for k in checked.kept) + checked.positions.size * 4
    return {"codec": summary, "nbytes": int(nbytes)}


def codec_blob_of_files(canvases: list[str], positions: str, fps: Any, *, name: str) -> bytes:
    """`codec_blob` of the training form (`read_codec_files`)."""
    checked, formats = _check_files(canvases, positions, fps, DEFAULT_PATCH, name, AssetFiles())
    data = []
    for k in checked.kept:
        with open_regular(canvases[k]) as f:
            data.append(f.read())
    return codec.pack_codec_blob(data, [formats[k] for k in checked.kept], checked.positions)


def _checked(
    folder: str, name: str, files: AssetFiles
) -> tuple[codec.CodecCanvases, list[str], list[str], int]:
    """The checked assets, the canvas paths and formats, and the patch size of a codec folder."""
    meta = _read_meta(folder, files, name)
    paths = [files.join(folder, n) for n in _canvas_names(folder, meta, name)]
    patch = _patch_size(meta, name)
    positions = files.join(folder, POSITIONS)
    checked, formats = _check_files(paths, positions, meta.get("fps"), patch, name, files)
    return checked, paths, formats, patch


def _check_files(
    paths: list[str], positions_path: str, fps: Any, patch: int, name: str, files: AssetFiles
) -> tuple[codec.CodecCanvases, list[str]]:
    """The checked assets of canvas files, a positions file and an fps, and the canvases' formats."""
    sizes, formats = [], []
    for path in paths:
        try:
            with files.open(path) as f:
                w, h, fmt = read_image_size(f)
        except (OSError, ValueError) as exc:
            raise codec.CodecAssetError(
                f"codec video {name}: canvas {os.path.basename(path)}: {exc}"
            ) from None
        if fmt not in CANVAS_FORMATS:
            raise codec.CodecAssetError(
                f"codec video {name}: canvas {os.path.basename(path)} is {fmt}; make them with --canvas_format jpg"
            )
        sizes.append((w, h))
        formats.append(fmt)
    try:
        with files.open(positions_path) as f:
            positions = np.load(f, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise codec.CodecAssetError(
            f"codec video {name}: cannot read {os.path.basename(positions_path)}: {exc}"
        ) from None
    return codec.check_canvases(sizes, positions, fps, patch_size=patch, name=name), formats


def _read_meta(folder: str, files: AssetFiles, name: str = "") -> dict[str, Any]:
    label = name or folder
    try:
        with files.open(files.join(folder, META)) as f:
            text = f.read(MAX_META_BYTES + 1)
        if len(text) > MAX_META_BYTES:
            raise ValueError(f"longer than {MAX_META_BYTES} bytes")
        meta = json.loads(text)
    except (OSError, ValueError) as exc:
        raise codec.CodecAssetError(f"codec video {label}: cannot read its {META}: {exc}") from None
    if not isinstance(meta, dict):
        raise codec.CodecAssetError(f"codec video {label}: {META} is not a JSON object")
    block = meta.get("block_size", codec.MERGE_SIZE)
    if block != codec.MERGE_SIZE:
        raise codec.CodecAssetError(
            f"codec video {label}: canvases of {block}x{block} patch blocks; LLaVA-OneVision-2 merges "
            f"{codec.MERGE_SIZE}x{codec.MERGE_SIZE} (rerun cv-preinfer with its default block size)"
        )
    return meta


def _patch_size(meta: dict[str, Any], name: str) -> int:
    patch = meta.get("patch", DEFAULT_PATCH)  # cv-preinfer records the one it used
    if isinstance(patch, bool) or not isinstance(patch, int) or patch < 1:
        raise codec.CodecAssetError(
            f"codec video {name}: meta.json patch {patch!r} is not a positive integer"
        )
    return patch


def _canvas_names(folder: str, meta: dict[str, Any], name: str = "") -> list[str]:
    """The canvas file names in model order: meta.json's `canvas_files`, else the folder's canvas_*.jpg/png."""
    names = meta.get("canvas_files")
    if not names and not is_url(folder):
        found = sorted(os.listdir(folder))
        for ext in CANVAS_FORMATS:
            names = [n for n in found if n.startswith("canvas_") and n.endswith("." + ext)]
            if names:
                break
    label = name or folder
    if not isinstance(names, list) or not names or len(names) > MAX_CANVASES:
        raise codec.CodecAssetError(
            f"codec video {label}: no canvases (or over {MAX_CANVASES}) listed in meta.json's canvas_files or found "
            "in the folder (a URL folder needs them listed)"
        )
    for n in names:
        if not isinstance(n, str) or n in ("", ".", "..") or "/" in n or "\\" in n or "\x00" in n:
            raise codec.CodecAssetError(f"codec video {label}: canvas name {n!r} is not a file of its folder")
    return names
