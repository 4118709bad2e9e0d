"""Turns the bin records of one micro-batch into the loader's output arrays (numpy; torch only in loader.py)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from dataloader.readers import BinRecord
from packing.image_tokens import ImageTokenRule, image_to_patches
from packing.layout import build_packed_sequence, collate_packed


@dataclass(kw_only=True, frozen=True)
class CollateConfig:
    """What collation needs from the manifest, plus the attention-mask switch."""

    seq_len: int
    pad_id: int
    image_pad_id: int
    rule: ImageTokenRule
    build_attention_mask: bool = False


def decode_image_patches(data: bytes, grid_thw: np.ndarray, rule: ImageTokenRule) -> np.ndarray:
    """Decodes encoded image bytes with Pillow and returns its patches at the stored grid."""
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        t, gh, gw = (int(v) for v in grid_thw)
        return image_to_patches(img, rule, grid_thw=(t, gh, gw))


def collate_bins(records: Sequence[BinRecord], cfg: CollateConfig) -> dict[str, Any]:
    """One micro-batch: packed layout of every bin (packing.layout) plus the image patches, as numpy."""
    seqs = []
    patches: list[np.ndarray] = []
    grids: list[np.ndarray] = []
    for rec in records:
        if len(rec["input_ids"]) > cfg.seq_len:
            raise ValueError(f"bin {rec['key']} has {len(rec['input_ids'])} tokens > seq_len {cfg.seq_len}")
        seqs.append(
            build_packed_sequence(
                rec["input_ids"],
                rec["loss_mask"],
                rec["seq_lens"],
                pad_to=cfg.seq_len,
                pad_id=cfg.pad_id,
                build_attention_mask=cfg.build_attention_mask,
                ignore_ids=(cfg.image_pad_id,) if cfg.image_pad_id >= 0 else (),
            )
        )
        grid = np.asarray(rec["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
        if len(grid) != len(rec["images"]):
            raise ValueError(f"bin {rec['key']}: {len(rec['images'])} images but {len(grid)} grids")
        expected_pads = sum(cfg.rule.tokens_of_grid(tuple(g)) for g in grid)
        got_pads = int(np.count_nonzero(np.asarray(rec["input_ids"]) == cfg.image_pad_id)) if len(grid) else 0
        if got_pads != expected_pads:
            raise ValueError(
                f"bin {rec['key']}: {got_pads} <|image_pad|> tokens, its images need {expected_pads}"
            )
        for data, g in zip(rec["images"], grid):
            patches.append(decode_image_patches(data, g, cfg.rule))
            grids.append(g)
    out = dict(collate_packed(seqs))
    width = 3 * cfg.rule.patch_size**2
    out["pixel_values"] = np.concatenate(patches) if patches else np.zeros((0, width), dtype=np.float32)
    out["image_grid_thw"] = np.stack(grids) if grids else np.zeros((0, 3), dtype=np.int64)
    return out
