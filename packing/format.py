"""The on-disk contract of a packed dataset, shared by the writer (offline_packing) and the reader (dataloader).

Pure constants and small helpers; no pyarrow, no torch. See DESIGN.md "Packed dataset". The manifest's
model (records, version rule, path checks) is `mmpack.packing.manifest`.

Layout of a dataset folder (local path or fsspec URL)::

    manifest.json                 written last, atomically (commit point)
    shards/<prefix>-000000.arrow  Arrow IPC file, one row per bin
    shards/<prefix>-000000.tar    WebDataset tar, one group of members per bin
    rejects.jsonl                 one JSON object per rejected input sample
    stats.json                    `mmpack stats --json` of the dataset

Bins are numbered globally 0..num_bins-1 in shard order. With `--format both`, shard i of each
format holds exactly the same bins (boundaries are decided once).
"""

from __future__ import annotations

import re

FORMAT_NAME = "mmpack-packed"
# The manifest's version rule lives in mmpack.packing.manifest: versions 1..FORMAT_VERSION load, newer ones are refused.
FORMAT_VERSION = 3
MANIFEST_NAME = "manifest.json"
REJECTS_NAME = "rejects.jsonl"
STATS_NAME = "stats.json"
SHARDS_DIR = "shards"
SHARD_FORMATS = ("arrow", "wds")
# Images larger than this many pixels are rejects offline and refused by the loader before decoding, unless
# the manifest records another limit (`image_rule.max_image_pixels`). Below Pillow's own warning level
# (89M pixels): one such RGB image costs ~120 MB once decoded, in every loader worker.
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000

# One record per bin. Field -> numpy dtype of its elements (list columns in Arrow, .npy members in tars).
ARRAY_FIELDS: dict[str, str] = {
    "input_ids": "uint32",  # unpadded concatenation of the bin's samples
    "loss_mask": "uint8",  # 1 where the token is a target (assistant content + its closing <|im_end|>)
    "seq_lens": "int32",  # one per sample; the compact block-diagonal causal mask
    "image_grid_thw": "int32",  # [n_images, 3] (t, h, w) in patches, before the merge
}
# Other per-bin fields: "key" (str), "sample_ids" (list[str], one per sample),
# "images" (list[bytes], encoded as read, in order of appearance), "image_formats" (list[str], e.g. "jpg").

# Video fields (format version 3), only in datasets with videos (Arrow: columns of every shard of such a
# dataset; WebDataset: members of the bins that hold videos), so image-only datasets keep their bytes:
# "videos" (list[bytes], the files as read, never re-encoded), "video_formats" (list[str], e.g. "mp4"),
# "video_plans" (list[str]: JSON of `mmpack.packing.video_tokens.VideoPlan.to_dict`, with the frame indices,
# grid, seconds per temporal patch, frame-count exactness and frame rate), and:
VIDEO_ARRAY_FIELDS: dict[str, str] = {
    "video_grid_thw": "int32",  # [n_videos, 3] (t, h, w) in patches, t = sampled frames / temporal patch
}

# WebDataset members of one bin with key K: K.json (key, sample_ids, image_formats, n_images; with videos also
# video_formats, video_plans, n_videos), K.input_ids.npy, K.loss_mask.npy, K.seq_lens.npy,
# K.image_grid_thw.npy, K.img<i>.<ext> per image; with videos K.video_grid_thw.npy and K.vid<i>.<ext> per video.
WDS_JSON_MEMBER = "json"
WDS_IMAGE_MEMBER = "img{index}.{ext}"
WDS_VIDEO_MEMBER = "vid{index}.{ext}"

_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+$")


def bin_key(prefix: str, bin_index: int) -> str:
    """The key of a bin: no dots, so WebDataset splits members correctly."""
    key = f"{prefix}-{bin_index:09d}"
    if not _KEY_RE.match(key):
        raise ValueError(f"shard prefix {prefix!r} must use only letters, digits, '_' and '-'")
    return key


def shard_name(prefix: str, shard_index: int, fmt: str) -> str:
    """Relative path of shard `shard_index` in format `fmt` ("arrow" or "wds")."""
    ext = {"arrow": "arrow", "wds": "tar"}[fmt]
    return f"{SHARDS_DIR}/{prefix}-{shard_index:06d}.{ext}"
