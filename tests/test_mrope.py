"""mmpack.packing.mrope: the packed 3-D positions equal transformers' `get_rope_index` on every sample alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmpack.packing.mrope import build_mrope_position_ids

IMAGE_PAD, VISION_START, VISION_END = 500, 501, 502


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    from mmpack.trainer.models.protocol import TinyModelSpec
    from mmpack.trainer.models.qwen2_5_vl import FAMILY

    cfg = FAMILY.tiny_hf_config(TinyModelSpec(
        vocab_size=512, image_token_id=IMAGE_PAD, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, num_layers=1, vision_depth=1,
    ))  # fmt: skip
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


VIDEO_PAD = 503


def _mixed_sample(rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[str, list[int], float]]]:
    """Text with a video, then 0..3 images and videos in random order; a video's grid t (>= 2 here) is its
    temporal patches."""
    from mmpack.packing.video_tokens import VideoMeta, VideoTokenRule

    ids: list[int] = list(rng.integers(1, 400, size=int(rng.integers(1, 8))))
    media: list[tuple[str, list[int], float]] = []
    for i in range(int(rng.integers(1, 5))):
        if i > 0 and rng.random() < 0.5:  # the first is a video, the others either
            grid, pad, interval = (
                [1, 2 * int(rng.integers(1, 5)), 2 * int(rng.integers(1, 5))],
                IMAGE_PAD,
                0.0,
            )
            media.append(("image", grid, interval))
        else:
            total, fps = int(rng.integers(100, 3000)), float(rng.choice([23.976, 25.0, 29.97, 59.94]))
            rule = VideoTokenRule(min_pixels=28 * 28, max_pixels=4 * 28 * 28)
            plan = rule.plan(
                VideoMeta(total_frames=total, fps=fps, width=100, height=60, duration_s=total / fps)
            )
            grid, pad, interval = list(plan.grid_thw), VIDEO_PAD, plan.second_per_grid_t
            media.append(("video", grid, interval))
        ids += [VISION_START, *[pad] * (grid[0] * grid[1] * grid[2] // 4), VISION_END]
        ids += list(rng.integers(1, 400, size=int(rng.integers(0, 4))))
    return np.asarray(ids, dtype=np.int64), media


@pytest.mark.parametrize("seed", range(4))
def test_packed_image_and_video_positions_equal_get_rope_index(hf_model, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    samples = [_mixed_sample(rng) for _ in range(3)]
    ids = np.concatenate([s[0] for s in samples])
    images = [g for _, media in samples for kind, g, _ in media if kind == "image"]
    videos = [(g, s) for _, media in samples for kind, g, s in media if kind == "video"]
    tokens_per_second = hf_model.config.vision_config.tokens_per_second
    spg = np.asarray([s for _, s in videos], dtype=np.float32)  # as the loader yields them
    kwargs = dict(
        image_pad_id=IMAGE_PAD, merge_size=2, video_pad_id=VIDEO_PAD, tokens_per_second=tokens_per_second
    )
    packed = build_mrope_position_ids(
        ids,
        [len(s[0]) for s in samples],
        np.asarray(images, dtype=np.int64).reshape(-1, 3),
        video_grid_thw=np.asarray([g for g, _ in videos], dtype=np.int64).reshape(-1, 3),
        second_per_grid_ts=spg,
        **kwargs,
    )
    start, differs_without_seconds = 0, 0
    for sample_ids, media in samples:
        t = torch.from_numpy(sample_ids)[None]
        types = (t == IMAGE_PAD).int() + 2 * (t == VIDEO_PAD).int()

        def grid(kind: str, media: list = media) -> torch.Tensor:
            return torch.tensor([g for k, g, _ in media if k == kind], dtype=torch.long).reshape(-1, 3)

        seconds = torch.tensor([s for k, _, s in media if k == "video"], dtype=torch.float32)
        ref, _ = hf_model.get_rope_index(
            t, types, image_grid_thw=grid("image"), video_grid_thw=grid("video"), second_per_grid_ts=seconds
        )
        assert packed[:, start : start + len(sample_ids)].tolist() == ref[:, 0].tolist()
        # control: Qwen2-VL's temporal positions (one per temporal patch) are another rule
        alone = build_mrope_position_ids(
            sample_ids,
            [len(sample_ids)],
            grid("image").numpy(),
            video_grid_thw=grid("video").numpy(),
            **(kwargs | {"tokens_per_second": 1.0}),
        )
        differs_without_seconds += alone.tolist() != ref[:, 0].tolist()
        start += len(sample_ids)
    assert differs_without_seconds == len(samples)


def test_video_grids_and_pads_must_agree() -> None:
    ids = np.array([7, *[VIDEO_PAD] * 2, 8])
    with pytest.raises(ValueError, match="more <\\|video_pad\\|> tokens"):
        build_mrope_position_ids(
            ids, [4], np.zeros((0, 3)), image_pad_id=IMAGE_PAD, merge_size=2, video_pad_id=VIDEO_PAD
        )
    with pytest.raises(ValueError, match="second_per_grid_ts"):
        build_mrope_position_ids(
            ids, [4], np.zeros((0, 3)), image_pad_id=IMAGE_PAD, merge_size=2, video_pad_id=VIDEO_PAD,
            video_grid_thw=np.array([[2, 2, 2]]), second_per_grid_ts=[1.0, 2.0],
        )  # fmt: skip
    pos = build_mrope_position_ids(
        ids, [4], np.zeros((0, 3)), image_pad_id=IMAGE_PAD, merge_size=2, video_pad_id=VIDEO_PAD,
        video_grid_thw=np.array([[2, 2, 2]]), second_per_grid_ts=[1.0], tokens_per_second=3,
    )  # fmt: skip
    assert pos.tolist() == [[0, 1, 4, 2], [0, 1, 1, 2], [0, 1, 1, 2]]
