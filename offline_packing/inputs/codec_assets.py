"""LLaVA-OneVision-2 codec-stream videos given as `cv-preinfer` output folders: where a record names a video,
it may name such a folder (resolved like a video path) holding `meta.json` (`fps`, `canvas_files`, `patch`,
`block_size`), `src_patch_position.npy` and the canvases. The scan reads the folder's canvas headers, positions
and fps and records a summary (`read_codec_folder`); the write stage packs the kept canvases as read and their
block-ordered positions into one blob (`codec_blob`). The rules are `mmpack.packing.video_codec_ov2`'s.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from mmpack.packing import video_codec_ov2 as codec
from mmpack.packing.fileio import open_regular
from mmpack.packing.image_tokens import read_image_size

META = "meta.json"
POSITIONS = "src_patch_position.npy"
CANVAS_FORMATS = ("jpg", "png")
MAX_META_BYTES = 64 << 20  # meta.json: a few hundred KB for 256 frames; past this it is no cv-preinfer output
MAX_CANVASES = 4096  # cv-preinfer writes at most a few dozen per video


def is_codec_folder(path: str) -> bool:
    """Whether a local video path is a `cv-preinfer` output folder (a folder holding its meta.json or positions)."""
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in (META, POSITIONS))


def asset_files(folder: str) -> list[str]:
    """The files of a codec folder the scan and the write stage read: meta.json, the positions, the canvases
    (CodecAssetError where meta.json is missing or unreadable, or names a canvas outside the folder)."""
    meta = _read_meta(folder)
    return [os.path.join(folder, META), os.path.join(folder, POSITIONS)] + [
        os.path.join(folder, n) for n in _canvas_names(folder, meta)
    ]


def read_codec_folder(folder: str, *, name: str) -> dict[str, Any]:
    """The scan's `video_info` of a codec folder: its summary (`video_codec_ov2.codec_summary`) under "codec"
    and the bytes the packed blob will hold; CodecAssetError naming `name` where the assets do not fit."""
    checked, files, _, patch = _checked(folder, name)
    summary = codec.codec_summary(checked, patch_size=patch)
    nbytes = sum(os.path.getsize(files[k]) for k in checked.kept) + checked.positions.size * 4
    return {"codec": summary, "nbytes": int(nbytes)}


def codec_blob(folder: str, *, name: str) -> bytes:
    """The packed form of a codec folder (`video_codec_ov2.pack_codec_blob`): the kept canvases as read and their
    block-ordered positions (checked again: the folder is read anew)."""
    checked, files, formats, _ = _checked(folder, name)
    data = []
    for k in checked.kept:
        with open_regular(files[k]) as f:
            data.append(f.read())
    return codec.pack_codec_blob(data, [formats[k] for k in checked.kept], checked.positions)


def _checked(folder: str, name: str) -> tuple[codec.CodecCanvases, list[str], list[str], int]:
    """The checked assets, the canvas paths and formats, and the patch size of a codec folder."""
    meta = _read_meta(folder, name)
    files = [os.path.join(folder, n) for n in _canvas_names(folder, meta, name)]
    sizes, formats = [], []
    for path in files:
        try:
            w, h, fmt = read_image_size(path)
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
        with open_regular(os.path.join(folder, POSITIONS)) as f:
            positions = np.load(f, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise codec.CodecAssetError(f"codec video {name}: cannot read {POSITIONS}: {exc}") from None
    patch = _patch_size(meta, name)
    checked = codec.check_canvases(sizes, positions, meta.get("fps"), patch_size=patch, name=name)
    return checked, files, formats, patch


def _read_meta(folder: str, name: str = "") -> dict[str, Any]:
    label = name or folder
    try:
        with open_regular(os.path.join(folder, META)) as f:
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
    patch = meta.get("patch", 14)  # cv-preinfer's default, which its meta.json records
    if isinstance(patch, bool) or not isinstance(patch, int) or patch < 1:
        raise codec.CodecAssetError(
            f"codec video {name}: meta.json patch {patch!r} is not a positive integer"
        )
    return patch


def _canvas_names(folder: str, meta: dict[str, Any], name: str = "") -> list[str]:
    """The canvas file names in model order: meta.json's `canvas_files`, else the folder's canvas_*.jpg/png."""
    names = meta.get("canvas_files")
    if not names:
        found = sorted(os.listdir(folder))
        for ext in CANVAS_FORMATS:
            names = [n for n in found if n.startswith("canvas_") and n.endswith("." + ext)]
            if names:
                break
    label = name or folder
    if not isinstance(names, list) or not names or len(names) > MAX_CANVASES:
        raise codec.CodecAssetError(
            f"codec video {label}: no canvases (or over {MAX_CANVASES}) listed or found"
        )
    for n in names:
        if not isinstance(n, str) or n in ("", ".", "..") or "/" in n or "\\" in n or "\x00" in n:
            raise codec.CodecAssetError(f"codec video {label}: canvas name {n!r} is not a file of its folder")
    return names
