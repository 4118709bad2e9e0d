"""The record both shard readers return for one bin."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

# key, input_ids (uint32), loss_mask (uint8), seq_lens (int32), sample_ids (list[str]), images (list[bytes]),
# image_formats (list[str]), image_grid_thw (int32 [n, 3]), videos (list[bytes]), video_formats (list[str]),
# video_grid_thw (int32 [n, 3]), video_plans (list[dict]: `mmpack.packing.video_tokens.VideoPlan.to_dict` per video;
# empty for datasets without videos)
BinRecord = dict[str, Any]


def no_videos() -> BinRecord:
    """The video fields of a bin without videos."""
    return {
        "videos": [],
        "video_formats": [],
        "video_grid_thw": np.zeros((0, 3), np.int32),
        "video_plans": [],
    }


def video_plan_dicts(stored: list[Any], where: str) -> list[dict]:
    """The video plans of a bin as dicts, from their stored form (JSON text in Arrow, objects in WebDataset)."""
    try:
        plans = [json.loads(p) if isinstance(p, (str, bytes)) else p for p in stored]
    except ValueError as e:
        raise ValueError(f"{where}: a video plan is not valid JSON ({e})") from None
    if not all(isinstance(p, dict) for p in plans):
        raise ValueError(f"{where}: video plans must be JSON objects")
    return plans
