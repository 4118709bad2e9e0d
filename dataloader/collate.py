"""Turns the bin records of one micro-batch into the loader's output arrays (numpy; torch only in loader.py).

Images are decoded with Pillow; videos (format version 3 datasets) by `mmpack.dataloader.video`, which decodes only
the frames the offline plan recorded, in the worker that collates.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from mmpack.dataloader.readers import BinRecord
from mmpack.dataloader.video import VideoPixels, collate_videos, load_video
from mmpack.packing.format import DEFAULT_MAX_IMAGE_PIXELS
from mmpack.packing.image_tokens import ImageTokenRule, image_to_patches
from mmpack.packing.layout import IGNORE_INDEX, build_attention_mask_from_cu_seqlens
from mmpack.packing.video_tokens import VideoPlan

if TYPE_CHECKING:
    from mmpack.dataloader.manifest import Manifest


@dataclass(kw_only=True, frozen=True)
class CollateConfig:
    """What collation needs from the manifest, plus the attention-mask switch."""

    seq_len: int
    pad_id: int
    image_pad_id: int
    rule: ImageTokenRule
    build_attention_mask: bool = False
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # the manifest's image_rule.max_image_pixels
    video_pad_id: int = -1  # the manifest's <|video_pad|> id (-1: the tokenizer has none)

    @classmethod
    def from_manifest(cls, manifest: Manifest, *, build_attention_mask: bool = False) -> CollateConfig:
        """The collation of a packed dataset: its length, pad ids, image rule and pixel limit."""
        return cls(
            seq_len=manifest.seq_len,
            pad_id=manifest.pad_id,
            image_pad_id=manifest.image_pad_id,
            rule=manifest.image_rule,
            build_attention_mask=build_attention_mask,
            max_image_pixels=manifest.max_image_pixels,
            video_pad_id=manifest.video_pad_id,
        )


class ImageTooLargeError(ValueError):
    """An image over the dataset's pixel limit, found from its header before decoding; `row` is its bin's
    index in the micro-batch."""

    def __init__(self, message: str, row: int = -1):
        super().__init__(message)
        self.row = row


def decode_image_patches(
    data: bytes,
    grid_thw: np.ndarray,
    rule: ImageTokenRule,
    *,
    max_pixels: int | None = None,
    where: str = "image",
) -> np.ndarray:
    """Decodes encoded image bytes with Pillow and returns its patches at the stored grid; an image over
    `max_pixels` is refused from its header (Image.open reads only that), before any decoding."""
    with Image.open(io.BytesIO(data)) as img:
        width, height = img.size
        if max_pixels is not None and width * height > max_pixels:
            raise ImageTooLargeError(
                f"{where} is {width}x{height} ({width * height} pixels), over the dataset's limit of "
                f"{max_pixels} pixels (manifest image_rule.max_image_pixels); repack the data with "
                "mmpack pack, which rejects such images"
            )
        img.load()
        t, gh, gw = (int(v) for v in grid_thw)
        return image_to_patches(img, rule, grid_thw=(t, gh, gw))


def collate_bins(
    records: Sequence[BinRecord],
    cfg: CollateConfig,
    pixel_out: Callable[[int, int], np.ndarray] | None = None,
) -> dict[str, Any]:
    """One micro-batch, as numpy: the packed layout of every bin plus the image patches.

    Rows are written straight into the batch arrays; the result equals `mmpack.packing.layout.collate_packed` over
    `build_packed_sequence` of each bin (the reference, checked by the tests), without its per-row copies.
    Each image's patches go straight into `pixel_values`, sized from the grids before decoding, so a batch
    never holds its patches twice; `pixel_out(rows, width)` may provide that float32 array (a loader worker
    hands out shared memory, so the patches need no copy on their way to the consumer).
    """
    if not records:
        raise ValueError("collate_bins needs at least one bin")
    b, length = len(records), cfg.seq_len
    width = cfg.rule.patch_dim
    n_rows = sum(
        int(np.prod(np.asarray(rec["image_grid_thw"], dtype=np.int64).reshape(-1, 3), axis=1).sum())
        for rec in records
    )
    pixels = (
        np.zeros((0, width), dtype=np.float32)
        if n_rows == 0
        else pixel_out(n_rows, width)
        if pixel_out is not None
        else np.empty((n_rows, width), dtype=np.float32)
    )
    row_at = 0
    tokens = np.full((b, length), cfg.pad_id, dtype=np.int64)
    labels = np.full((b, length), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.empty((b, length), dtype=np.int64)
    cu: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
    max_seqlen = num_real = 0
    grids: list[np.ndarray] = []
    videos: list[VideoPixels] = []
    for row, rec in enumerate(records):
        ids = np.asarray(rec["input_ids"]).reshape(-1)
        mask = np.asarray(rec["loss_mask"]).reshape(-1)
        lens = np.asarray(rec["seq_lens"], dtype=np.int64).reshape(-1)
        total = int(ids.shape[0])
        if total > length:
            raise ValueError(f"bin {rec['key']} has {total} tokens > seq_len {length}")
        ends = np.cumsum(lens)
        if mask.shape[0] != total or (ends[-1] if lens.size else 0) != total:
            raise ValueError(
                f"bin {rec['key']}: input_ids ({total}) and loss_mask ({mask.shape[0]}) must both have "
                f"sum(seq_lens) = {int(ends[-1]) if lens.size else 0} tokens"
            )
        if lens.size and int(lens.min()) < 1:
            raise ValueError(f"bin {rec['key']}: seq_lens must all be >= 1, got {lens.tolist()}")
        tokens[row, :total] = ids
        if total > 1:
            # Position i predicts i + 1 when that is a target of the same sample and not an image pad.
            nxt = tokens[row, 1:total]
            keep = mask[1:] != 0
            keep[ends[:-1] - 1] = False
            if cfg.image_pad_id >= 0:
                keep &= nxt != cfg.image_pad_id
            if cfg.video_pad_id >= 0:
                keep &= nxt != cfg.video_pad_id
            np.copyto(labels[row, : total - 1], nxt, where=keep)
        segment_ends = ends if total == length else np.append(ends, length)
        segment_lens = np.diff(segment_ends, prepend=0)
        position_ids[row] = np.arange(length, dtype=np.int64) - np.repeat(
            segment_ends - segment_lens, segment_lens
        )
        cu.append(segment_ends + row * length)
        max_seqlen = max(max_seqlen, int(segment_lens.max()))
        num_real += total
        grid = np.asarray(rec["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
        if len(grid) != len(rec["images"]):
            raise ValueError(f"bin {rec['key']}: {len(rec['images'])} images but {len(grid)} grids")
        if len(grid):
            expected_pads = sum(cfg.rule.tokens_of_grid(tuple(g)) for g in grid)
            got_pads = int(np.count_nonzero(ids == cfg.image_pad_id))
            if got_pads != expected_pads:
                raise ValueError(
                    f"bin {rec['key']}: {got_pads} <|image_pad|> tokens, its images need {expected_pads}"
                )
        for i, (data, g) in enumerate(zip(rec["images"], grid)):
            where = f"bin {rec['key']} image {i}"
            try:
                patches = decode_image_patches(
                    data, g, cfg.rule, max_pixels=cfg.max_image_pixels, where=where
                )
            except ImageTooLargeError as e:
                raise ImageTooLargeError(str(e), row=row) from None
            pixels[row_at : row_at + len(patches)] = patches
            row_at += len(patches)
            grids.append(g)
        videos += decode_bin_videos(rec, ids, cfg)
    cu_seqlens = np.concatenate(cu).astype(np.int32)
    out: dict[str, Any] = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": (labels != IGNORE_INDEX).astype(np.float32),
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
        "max_seqlen": max_seqlen,
        "num_real_tokens": num_real,
    }
    if cfg.build_attention_mask:
        out["attention_mask"] = np.stack(
            [
                build_attention_mask_from_cu_seqlens(np.concatenate([[0], c - r * length]))[None]
                for r, c in enumerate(cu[1:])
            ]
        )
    if row_at != n_rows:  # the grids said how many; decode_image_patches makes that many per image
        raise ValueError(f"bins {[rec['key'] for rec in records]}: {row_at} patch rows, grids need {n_rows}")
    out["pixel_values"] = pixels
    out["image_grid_thw"] = np.stack(grids) if grids else np.zeros((0, 3), dtype=np.int64)
    out |= collate_videos(videos)
    if not videos:
        out["pixel_values_videos"] = np.zeros((0, width), dtype=np.float32)
    return out


def decode_bin_videos(rec: BinRecord, ids: np.ndarray, cfg: CollateConfig) -> list[VideoPixels]:
    """The planned frames of each video of one bin, as model inputs; checks plans, grids and pad count."""
    stored = rec.get("video_plans", ())
    plans = [VideoPlan.from_dict(p) for p in stored]
    grid = np.asarray(rec.get("video_grid_thw", np.zeros((0, 3))), dtype=np.int64).reshape(-1, 3)
    data = rec.get("videos", ())
    if not (len(plans) == len(grid) == len(data)):
        raise ValueError(f"bin {rec['key']}: {len(data)} videos, {len(plans)} plans, {len(grid)} grids")
    if not plans:
        return []
    if cfg.video_pad_id < 0:
        raise ValueError(
            f"bin {rec['key']} holds videos but the manifest's tokenizer has no <|video_pad|> id"
        )
    expected_pads = sum(p.num_tokens for p in plans)
    got_pads = int(np.count_nonzero(ids == cfg.video_pad_id))
    if got_pads != expected_pads:
        raise ValueError(
            f"bin {rec['key']}: {got_pads} <|video_pad|> tokens, its videos need {expected_pads}"
        )
    out = []
    for i, (blob, plan, g) in enumerate(zip(data, plans, grid)):
        if tuple(int(v) for v in g) != tuple(plan.grid_thw):
            raise ValueError(
                f"bin {rec['key']} video {i}: grid {g.tolist()} differs from its plan's {plan.grid_thw}"
            )
        out.append(load_video(blob, plan, cfg.rule, name=_video_name(stored[i], rec["key"], i)))
    return out


def _video_name(plan: dict, key: str, i: int) -> str:
    """How errors name a video: as its record named it, with its sample (datasets packed since these were
    recorded), and where it is in the shard."""
    where = f"bin {key} video {i}"
    if "source" not in plan:
        return where
    return f"{plan['source']} of sample {plan.get('sample_id')!r} ({where})"
