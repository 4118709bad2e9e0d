"""Helpers for the bad-sample tests (no tests here): a small packed dataset of images and videos, and copies of it
with one sample's video bytes damaged inside the shard, or with that sample's labels masked (the control a
dropped sample must train like)."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

SEQ_LEN = 1024
BAD_SAMPLE = "video-0"  # an mp4 (H.264) clip of `add_synthetic_videos`, alone in its sample
# LLaVA-OneVision-2's video rule (each frame an image in a `<|image_pad|>` block; its processor's temporal patch 1
# and pixel bounds): its record holding both an image and videos is rejected, the others packed
OV2_OPTIONS: dict[str, Any] = {
    "video_style": "llava_onevision2",
    "temporal_patch_size": 1,
    "min_pixels": 3136,
    "max_pixels": 50176,
    "video_image_min_pixels": 3136,
    "video_image_max_pixels": 50176,
}


def zero_frame_bytes(data: bytes) -> bytes:
    """An mp4 with every byte of its `mdat` box's payload (the coded frames) zeroed; the index (`moov`) intact, so
    its container metadata still reads as before."""
    out = bytearray(data)
    at = 0
    while at + 8 <= len(out):
        size, kind = struct.unpack(">I4s", out[at : at + 8])
        header = 8
        if size == 1:  # a 64-bit size follows the type
            size, header = struct.unpack(">Q", out[at + 8 : at + 16])[0], 16
        elif size == 0:  # the box runs to the end of the file
            size = len(out) - at
        if kind == b"mdat":
            out[at + header : at + size] = bytes(size - header)
            return bytes(out)
        at += size
    raise ValueError("no mdat box: not an mp4 this helper can damage")


def pack_video_dataset(root: Path, **options: Any) -> Path:
    """Three synthetic image records and four video records (three tiny clips, one record with an image and two
    of them), packed by the real offline job with a tiny BPE; every sample packed (the videos pass the scan).
    `options`: packing options of another video rule (`OV2_OPTIONS`), which may reject some samples."""
    from mmpack.demo.synthetic import make_synthetic_dataset, pack_synthetic, train_tiny_bpe
    from mmpack.demo.videos import add_synthetic_videos

    raw = make_synthetic_dataset(root / "raw", n_samples=3, seed=7, size_range=(28, 84), max_words=20)
    raw = add_synthetic_videos(raw, 3, seed=7)
    tokenizer = train_tiny_bpe(root / "tok", seed=7, video_pad=True)
    out = root / "packed"
    summary = pack_synthetic(raw, tokenizer, out, seq_len=SEQ_LEN, format="arrow", **options)
    assert options or summary.samples_rejected == 0, summary.rejected_by_reason
    return out


def rewrite_sample(
    dataset: Path, out: Path, sample_id: str, change: Callable[[dict[str, Any], int], None]
) -> dict[str, Any]:
    """A copy of `dataset` at `out` whose bin holding `sample_id` is changed by `change(row, k)` (the bin's Arrow
    row as Python values, the sample's index in it); the shard's size and sha256 in the manifest follow, as if
    the dataset had been packed so. Returns the changed row."""
    import pyarrow as pa

    shutil.copytree(dataset, out)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["shards"]:
        path = out / entry["path"]
        with pa.ipc.open_file(str(path)) as f:
            table = f.read_all()
        rows = table.to_pylist()
        hit = [(r, r["sample_ids"].index(sample_id)) for r in rows if sample_id in r["sample_ids"]]
        if not hit:
            continue
        change(*hit[0])
        path.unlink()
        with pa.ipc.new_file(str(path), table.schema) as writer:
            writer.write_table(pa.Table.from_pylist(rows, schema=table.schema))
        data = path.read_bytes()
        entry["sha256"], entry["bytes"] = hashlib.sha256(data).hexdigest(), len(data)
        manifest_path.write_text(json.dumps(manifest, indent=2))
        return hit[0][0]
    raise ValueError(f"no bin of {dataset} holds sample {sample_id!r}")


def sample_span(row: dict[str, Any], k: int) -> tuple[int, int]:
    """[start, end) of sample k's tokens in its bin."""
    start = sum(row["seq_lens"][:k])
    return start, start + row["seq_lens"][k]


def damage_video(row: dict[str, Any], k: int) -> None:
    """Zeroes the frame bytes of sample k's videos (`change` of `rewrite_sample`)."""
    sid = row["sample_ids"][k]
    for i, plan in enumerate(row["video_plans"]):
        if json.loads(plan).get("sample_id") == sid:
            row["videos"][i] = zero_frame_bytes(row["videos"][i])


def mask_labels(row: dict[str, Any], k: int) -> None:
    """Zeroes sample k's loss mask (`change` of `rewrite_sample`): the bin a dropped sample should train like."""
    start, end = sample_span(row, k)
    row["loss_mask"][start:end] = [0] * (end - start)


def codec_bin(rec: dict[str, Any], rule: Any) -> dict[str, Any]:
    """A LLaVA-OneVision-2 frames-as-images bin (as a shard reader gives it) whose one video is stored as a codec
    blob instead (`mmpack.packing.video_codec_ov2`): one random PNG canvas per frame, each frame's run of pads
    one run of the codec plan, the canvases' block positions as their source positions."""
    import io

    import numpy as np
    from PIL import Image

    from mmpack.packing.patch_positions import block_patch_positions
    from mmpack.packing.video_codec_ov2 import pack_codec_blob

    [plan] = rec["video_plans"]
    t, h, w = plan["grid_thw"]
    rng = np.random.default_rng(0)
    canvases = []
    for _ in range(t):
        buf = io.BytesIO()
        pixels = rng.integers(0, 256, (h * rule.patch_size, w * rule.patch_size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buf, format="PNG")
        canvases.append(buf.getvalue())
    positions = block_patch_positions(np.asarray([[t, h, w]]), rule.merge_size)
    runs = [h * w // rule.merge_size**2] * t
    codec_plan = {**plan, "run_tokens": runs}
    return {**rec, "videos": [pack_codec_blob(canvases, ["png"] * t, positions)], "video_plans": [codec_plan]}


def codec_grid(rec: dict[str, Any]) -> list[int]:
    """The grid row [N, h, w] of a `codec_bin`'s video."""
    return list(rec["video_plans"][0]["grid_thw"])
