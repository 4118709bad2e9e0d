"""One bin as the model sees it: read by the loader's shard reader, collated by the loader's `collate_bins` (the
trainer's micro-batch), and turned into what the page shows: tokens, trained marks, positions, and the model's
pixels written as PNG files next to the page."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmpack.dataloader.collate import CollateConfig, collate_bins
from mmpack.dataloader.manifest import Manifest
from mmpack.dataloader.readers import BinRecord
from mmpack.packing.batch import PositionRule
from mmpack.packing.image_tokens import ImageTokenRule, patches_to_image
from mmpack.packing.layout import IGNORE_INDEX
from mmpack.packing.mrope import MRopeRule
from mmpack.packing.patch_positions import TextPositionRule
from mmpack.view.tokens import TokenDecoder


def position_rule_for(manifest: Manifest, name: str = "auto") -> PositionRule | None:
    """The position rule the page shows: `auto` follows the dataset's video style (Qwen3-VL's frames apart,
    LLaVA-OneVision-2's 1-D text positions, else Qwen2.5-VL's M-RoPE); `1d` is the rule-less 1-D positions."""
    if name == "auto":
        rule = manifest.dataset.video_rule
        style = rule.style if rule is not None else ""
        name = {"qwen3_vl": "mrope-frames-apart", "llava_onevision2": "text"}.get(style, "mrope")
    if name == "1d":
        return None
    if name == "text":
        return TextPositionRule(merge_size=manifest.merge_size)
    return MRopeRule(
        image_pad_id=manifest.image_pad_id,
        merge_size=manifest.merge_size,
        video_pad_id=manifest.video_pad_id,
        video_frames_apart=name == "mrope-frames-apart",
    )


_BYTES_OBJECT = re.compile(r"<_io\.BytesIO object at 0x[0-9a-f]+>")


@dataclass(frozen=True)
class BinContext:
    """What every bin of one dataset is rendered with."""

    manifest: Manifest
    collate: CollateConfig
    decoder: TokenDecoder
    media_dir: Path  # DIR/media
    media_url: str = "media"  # how the page names that folder
    alias: tuple[
        tuple[str, str], ...
    ] = ()  # (prefix, shown instead) of sample ids: a raw preview's copied file

    def rename(self, sample_id: str) -> str:
        """The id as the page shows it (the original file's path for a raw preview's copy)."""
        return renamed(sample_id, self.alias)


def renamed(text: str, alias: tuple[tuple[str, str], ...]) -> str:
    """`text` with the first matching prefix of `alias` replaced."""
    for old, new in alias:
        if text.startswith(old):
            return new + text[len(old) :]
    return text


def sample_source(sample_id: str) -> str:
    """The file a sample came from, where its id says it (`file:line`, the packer's id of a record without
    one); empty where the record named its own id."""
    head, sep, tail = sample_id.rpartition(":")
    return head if sep and tail.isdigit() else ""


def bin_view(
    ctx: BinContext, rec: BinRecord, bin_id: int, shard: str, source: int | None = None
) -> dict[str, Any]:
    """The page's data of one bin (JSON values); its images and video frames are written under `media_dir`.
    `source`: the bin's source in a mixture (`ctx.collate.sources`), whose image rule decodes it."""
    source_ids = None if source is None else np.array([source])
    batch = collate_bins([rec], ctx.collate, bin_ids=np.array([bin_id]), source_ids=source_ids)
    n = int(batch.num_real_tokens)
    ids = batch.tokens[0, :n]
    labels = batch.labels[0, :n]
    trained = np.zeros(n, dtype=bool)
    trained[1:] = labels[:-1] != IGNORE_INDEX  # token j is trained when the model learns to predict it
    pos = batch.position_ids
    axes = pos[:, 0, :n] if pos.ndim == 3 else pos[:, :n]
    seq_lens = np.asarray(rec["seq_lens"], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(seq_lens)[:-1]]).astype(np.int64)
    dropped = {
        d.sample_id: f"{d.media}: {_BYTES_OBJECT.sub('the stored bytes', d.error)}" for d in batch.dropped
    }
    samples = [
        {
            "id": ctx.rename(sid),
            "source": sample_source(ctx.rename(sid)),
            "start": int(s),
            "len": int(length),
            "trained": int(trained[s : s + length].sum()),
            "dropped": dropped.get(sid),
        }
        for sid, s, length in zip(rec["sample_ids"], starts, seq_lens)
    ]
    media = _images(ctx, batch.pixel_values, batch.image_grid_thw, ids, bin_id)
    media += _videos(ctx, batch.pixel_values_videos, batch.video_grid_thw, ids, bin_id)
    for m in media:
        m["sample"] = int(np.searchsorted(starts, m["at"], side="right") - 1)
    pieces = {str(int(t)): ctx.decoder.piece(int(t)) for t in np.unique(ids)}
    return {
        "bin": bin_id,
        "key": rec["key"],
        "shard": shard,
        "seq_len": int(ctx.collate.seq_len),
        "ids": ids.tolist(),
        "trained": np.flatnonzero(trained).tolist(),
        "pos": axes.tolist(),
        "pieces": pieces,
        "special": sorted(int(t) for t in np.unique(ids) if ctx.decoder.is_special(int(t))),
        "samples": samples,
        "media": media,
        "problems": [
            f"bin {rec['key']} ({shard}): sample {ctx.rename(k)} dropped by the loader: {v}"
            for k, v in dropped.items()
        ],
    }


def _runs(ids: np.ndarray, pad_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `pad_id` tokens."""
    if pad_id < 0:
        return []
    hit = np.concatenate([[0], (ids == pad_id).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(hit))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


def _images(
    ctx: BinContext, pixels: np.ndarray, grids: np.ndarray, ids: np.ndarray, bin_id: int
) -> list[dict[str, Any]]:
    rule = ctx.collate.rule
    merge2 = rule.merge_size**2
    runs = _runs(ids, ctx.collate.image_pad_id)
    out, row = [], 0
    for i, grid in enumerate(np.asarray(grids, dtype=np.int64)):
        n_rows = int(np.prod(grid))
        try:
            frame = _to_uint8(patches_to_image(pixels[row : row + n_rows], tuple(grid), rule), rule)
        except ValueError:  # a video frame given to the tower as an image: its temporal copies may differ
            frame = _video_frames(pixels[row : row + n_rows], (int(grid[1]), int(grid[2])), rule)[0]
        row += n_rows
        name = f"b{bin_id:09d}-img{i}.png"
        Image.fromarray(frame).save(ctx.media_dir / name)
        at, length = runs[i] if i < len(runs) else (-1, 0)
        out.append(
            {
                "kind": "image",
                "index": i,
                "files": [f"{ctx.media_url}/{name}"],
                "grid": grid.tolist(),
                "tokens": n_rows // merge2,
                "at": at,
                "run": length,
                "size": [int(frame.shape[1]), int(frame.shape[0])],
            }
        )
    return out


def _videos(
    ctx: BinContext, pixels: np.ndarray, grids: np.ndarray, ids: np.ndarray, bin_id: int
) -> list[dict[str, Any]]:
    """One entry per temporal patch of each video (its frames, placed at its first `<|video_pad|>`)."""
    rule = ctx.collate.rule
    merge2 = rule.merge_size**2
    pads = np.flatnonzero(ids == ctx.collate.video_pad_id) if ctx.collate.video_pad_id >= 0 else np.zeros(0)
    out: list[dict[str, Any]] = []
    row = pad_at = 0
    for v, (t, gh, gw) in enumerate(np.asarray(grids, dtype=np.int64).tolist()):
        per_step = gh * gw
        for step in range(t):
            frames = _video_frames(pixels[row : row + per_step], (gh, gw), rule)
            row += per_step
            files = []
            for f, frame in enumerate(frames):
                name = f"b{bin_id:09d}-vid{v}-t{step}-f{f}.png"
                Image.fromarray(frame).save(ctx.media_dir / name)
                files.append(f"{ctx.media_url}/{name}")
            tokens = per_step // merge2
            at = int(pads[pad_at]) if pad_at < len(pads) else -1
            pad_at += tokens
            out.append(
                {
                    "kind": "video",
                    "index": v,
                    "step": step,
                    "files": files,
                    "grid": [t, gh, gw],
                    "tokens": tokens,
                    "at": at,
                    "run": tokens,
                    "size": [int(frames[0].shape[1]), int(frames[0].shape[0])],
                }
            )
    return out


def _video_frames(rows: np.ndarray, grid_hw: tuple[int, int], rule: ImageTokenRule) -> list[np.ndarray]:
    """The `temporal_patch_size` frames of one temporal patch of a video, from its rows (the layout of
    `image_to_patches`, each row (channel, t, y, x)), as uint8 [H, W, 3]."""
    p, m, t = rule.patch_size, rule.merge_size, rule.temporal_patch_size
    gh, gw = grid_hw
    blocks = rows.reshape(gh // m, gw // m, m, m, 3, t, p, p)  # [wy, wx, dy, dx, C, T, py, px]
    # -> [T, C, wy, dy, py, wx, dx, px] -> [T, C, H, W]
    frames = blocks.transpose(5, 4, 0, 2, 6, 1, 3, 7).reshape(t, 3, gh * p, gw * p)
    return [_to_uint8(frame, rule) for frame in frames]


def _to_uint8(chw: np.ndarray, rule: ImageTokenRule) -> np.ndarray:
    """Normalised [3, H, W] pixels back to the 8-bit levels they were made from, as [H, W, 3]."""
    mean = np.asarray(rule.image_mean, dtype=np.float64)[:, None, None]
    std = np.asarray(rule.image_std, dtype=np.float64)[:, None, None]
    levels = (chw.astype(np.float64) * std + mean) / rule.rescale_factor
    return np.clip(np.rint(levels), 0, 255).astype(np.uint8).transpose(1, 2, 0)
