"""packing.mrope: the packed 3-D positions equal transformers' `get_rope_index` on every sample alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from packing.mrope import build_mrope_position_ids

IMAGE_PAD, VISION_START, VISION_END = 500, 501, 502


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    from trainer.models.qwen2_5_vl import tiny_hf_config

    cfg = tiny_hf_config(
        vocab_size=512, image_token_id=IMAGE_PAD, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, num_layers=1, vision_depth=1,
    )  # fmt: skip
    return Qwen2_5_VLModel(Qwen2_5_VLConfig(**cfg))


def _sample(rng: np.random.Generator) -> tuple[np.ndarray, list[list[int]]]:
    """Text with 0..3 images of random grids (in patches, even sides)."""
    ids: list[int] = list(rng.integers(1, 400, size=int(rng.integers(1, 12))))
    grids = []
    for _ in range(int(rng.integers(0, 4))):
        grid = [1, 2 * int(rng.integers(1, 7)), 2 * int(rng.integers(1, 7))]
        grids.append(grid)
        ids += [VISION_START, *[IMAGE_PAD] * (grid[1] * grid[2] // 4), VISION_END]
        ids += list(rng.integers(1, 400, size=int(rng.integers(0, 6))))
    return np.asarray(ids, dtype=np.int64), grids


@pytest.mark.parametrize("seed", range(5))
def test_packed_positions_equal_get_rope_index_per_sample(hf_model, seed: int) -> None:
    rng = np.random.default_rng(seed)
    samples = [_sample(rng) for _ in range(4)]
    ids = np.concatenate([s[0] for s in samples])
    grids = np.asarray([g for s in samples for g in s[1]], dtype=np.int64).reshape(-1, 3)
    packed = build_mrope_position_ids(
        ids, [len(s[0]) for s in samples], grids, image_pad_id=IMAGE_PAD, merge_size=2
    )
    start = 0
    for sample_ids, sample_grids in samples:
        t = torch.from_numpy(sample_ids)[None]
        grid = torch.tensor(sample_grids, dtype=torch.long).reshape(-1, 3) if sample_grids else None
        ref, _ = hf_model.get_rope_index(t, (t == IMAGE_PAD).int(), image_grid_thw=grid)
        assert packed[:, start : start + len(sample_ids)].tolist() == ref[:, 0].tolist()
        start += len(sample_ids)


def test_positions_restart_per_sample_and_bad_counts_raise() -> None:
    ids = np.array([7, 8, 9, 7, 8])
    assert build_mrope_position_ids(ids, [3, 2], np.zeros((0, 3)), image_pad_id=IMAGE_PAD, merge_size=2)[
        0
    ].tolist() == [0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="more <\\|image_pad\\|> tokens"):
        build_mrope_position_ids(
            np.array([IMAGE_PAD] * 4), [4], np.zeros((0, 3)), image_pad_id=IMAGE_PAD, merge_size=2
        )
    with pytest.raises(ValueError, match="more image grids"):
        build_mrope_position_ids(ids, [5], np.array([[1, 2, 2]]), image_pad_id=IMAGE_PAD, merge_size=2)
