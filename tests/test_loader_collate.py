"""The loader's collation equals mmpack.packing.layout's reference layout, bin for bin and key for key."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack.dataloader.collate import CollateConfig, collate_bins
from mmpack.packing.batch import contract_problems
from mmpack.packing.image_tokens import ImageTokenRule
from mmpack.packing.layout import build_packed_sequence, collate_packed

PAD, IMAGE_PAD = 0, 7


def _record(lens: list[int], rng: np.random.Generator, key: str) -> dict[str, Any]:
    total = sum(lens)
    ids = rng.integers(1, 12, size=total).astype(np.uint32)
    ids[ids == IMAGE_PAD] = 8  # no image pads: these bins carry no images
    return {
        "key": key,
        "input_ids": ids,
        "loss_mask": (rng.random(total) < 0.6).astype(np.uint8),
        "seq_lens": np.asarray(lens, dtype=np.int32),
        "images": [],
        "image_formats": [],
        "image_grid_thw": np.zeros((0, 3), dtype=np.int32),
        "sample_ids": [f"{key}-{i}" for i in range(len(lens))],
    }


def _reference(records: list[dict[str, Any]], cfg: CollateConfig) -> dict[str, Any]:
    rows = [
        build_packed_sequence(
            r["input_ids"],
            r["loss_mask"],
            r["seq_lens"],
            pad_to=cfg.seq_len,
            pad_id=cfg.pad_id,
            build_attention_mask=cfg.build_attention_mask,
            ignore_ids=(cfg.image_pad_id,),
        )
        for r in records
    ]
    return dict(collate_packed(rows))


bins_strategy = st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=5), min_size=1, max_size=3).filter(
    lambda bins: all(sum(b) <= 24 for b in bins)
)


@settings(max_examples=150, deadline=None)
@given(bins=bins_strategy, seed=st.integers(0, 2**31), mask=st.booleans(), full=st.booleans())
def test_collate_equals_layout_reference(bins: list[list[int]], seed: int, mask: bool, full: bool) -> None:
    rng = np.random.default_rng(seed)
    seq_len = max(sum(b) for b in bins) if full else 24  # full: the longest bin fills its row exactly
    seq_len = max(seq_len, 1)
    cfg = CollateConfig(
        seq_len=seq_len, pad_id=PAD, image_pad_id=IMAGE_PAD, rule=ImageTokenRule(), build_attention_mask=mask
    )
    records = [_record(b, rng, f"b{i}") for i, b in enumerate(bins)]
    # image pads inside text get no labels, like the reference's ignore_ids
    if records[0]["input_ids"].size > 2:
        records[0]["input_ids"][1] = IMAGE_PAD
        records[0]["image_grid_thw"] = np.zeros((0, 3), dtype=np.int32)
    batch = collate_bins(records, cfg)
    assert contract_problems(batch) == []
    got, want = dict(batch.items()), _reference(records, cfg)
    assert set(want) <= set(got)
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            assert got[key].dtype == value.dtype, key
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        else:
            assert got[key] == value, key
    assert got["pixel_values"].shape == (0, 3 * 2 * 14 * 14) and got["image_grid_thw"].shape == (0, 3)


def test_collate_errors_name_the_bin() -> None:
    rng = np.random.default_rng(0)
    cfg = CollateConfig(seq_len=8, pad_id=PAD, image_pad_id=IMAGE_PAD, rule=ImageTokenRule())
    with pytest.raises(ValueError, match="bin long has 10 tokens > seq_len 8"):
        collate_bins([_record([10], rng, "long")], cfg)
    bad = _record([3, 2], rng, "short")
    bad["loss_mask"] = bad["loss_mask"][:-1]
    with pytest.raises(ValueError, match="bin short: input_ids"):
        collate_bins([bad], cfg)
    zero = _record([3], rng, "zero")
    zero["seq_lens"] = np.array([3, 0], dtype=np.int32)
    with pytest.raises(ValueError, match="bin zero: seq_lens must all be >= 1"):
        collate_bins([zero], cfg)
    with pytest.raises(ValueError, match="at least one bin"):
        collate_bins([], cfg)
