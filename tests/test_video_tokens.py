"""The video-token rule (mmpack.packing.video_tokens) against the plain qwen-vl-utils 0.0.14 reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack.packing.video_tokens import (
    VideoMeta,
    VideoPlan,
    VideoRuleError,
    VideoTokenRule,
    sample_frame_indices,
)
from tests.support.reference import qwen_vl_video_plan
from tests.support.shared import SHARED_DIR, need_shared

DEMO_DIR = SHARED_DIR / "data" / "mllm_video_demo"


def _assert_plan_matches(plan: VideoPlan, ref: dict) -> None:
    assert list(plan.frame_indices) == ref["indices"]
    assert plan.resized_hw == ref["size"]
    assert plan.grid_thw == ref["grid"]
    assert plan.num_tokens == ref["tokens"]
    assert plan.second_per_grid_t == pytest.approx(ref["second_per_grid_t"], rel=1e-12)


@pytest.mark.shared
def test_demo_videos_tokens_equal_reference_rule() -> None:
    from mmpack.offline_packing.inputs.video_probe import probe_video

    records = DEMO_DIR / "mllm_video_demo.json"
    need_shared(records, what="the video demo")
    rule = VideoTokenRule()
    seen = {}
    for rec in json.loads(records.read_text()):
        for rel in rec["videos"]:
            meta = probe_video(DEMO_DIR / rel).meta
            plan = rule.plan(meta)
            ref = qwen_vl_video_plan(meta.total_frames, meta.fps, meta.height, meta.width)
            assert ref is not None
            _assert_plan_matches(plan, ref)
            seen[rel] = (meta.total_frames, plan.grid_thw, plan.num_tokens)
    # the container facts of SOURCE.md, and the tokens they give (checked by hand once: 243 frames at 25 fps
    # -> 19.44 -> 18 frames; 640x360 -> 644x364 (within 128..768 x 28 x 28) -> 9 x 13 x 23 tokens)
    assert seen == {
        "mllm_demo_data/1.mp4": (243, (9, 26, 46), 2691),
        "mllm_demo_data/2.avi": (270, (9, 20, 28), 1260),
        "mllm_demo_data/3.mp4": (146, (6, 26, 46), 1794),
    }


@settings(max_examples=400, deadline=None)
@given(
    total=st.integers(1, 200_000),
    fps=st.sampled_from([1.0, 8.0, 23.976023976023978, 25.0, 29.97, 30.0, 59.94, 120.0, 1000.0]),
    height=st.integers(1, 5000),
    width=st.integers(1, 5000),
    sample_fps=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
    min_frames=st.integers(1, 16),
    max_frames=st.sampled_from([8, 64, 768, 2048]),
    seq_len=st.sampled_from([16384, 128000]),
)
def test_rule_equals_reference(
    total, fps, height, width, sample_fps, min_frames, max_frames, seq_len
) -> None:
    rule = VideoTokenRule(
        fps=sample_fps,
        min_frames=min_frames,
        max_frames=max(max_frames, min_frames),
        total_pixels=seq_len * 28 * 28 * 0.9,
    )
    ref = qwen_vl_video_plan(
        total,
        fps,
        height,
        width,
        fps=sample_fps,
        min_frames=min_frames,
        max_frames=max(max_frames, min_frames),
        model_seq_len=seq_len,
    )
    meta = VideoMeta(total_frames=total, fps=fps, width=width, height=height, duration_s=total / fps)
    if ref is None:
        with pytest.raises(VideoRuleError) as info:
            rule.plan(meta)
        assert info.value.reason in ("video_too_short", "video_aspect_ratio", "video_too_small")
        return
    _assert_plan_matches(rule.plan(meta), ref)


def test_frame_indices_are_torch_linspace_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    totals = list(range(2, 300)) + [int(t) for t in rng.integers(300, 500_000, 400)]
    counts = [2, 4, 6, 10, 18, 34, 100, 256, 512, 766, 768]
    differs_from_float64 = 0
    for total in totals:
        for n in (c for c in counts if c <= total):
            expected = torch.linspace(0, total - 1, n).round().long().numpy()
            np.testing.assert_array_equal(sample_frame_indices(total, n), expected, err_msg=f"{total=} {n=}")
            differs_from_float64 += not np.array_equal(np.linspace(0, total - 1, n).round(), expected)
    # control: a float64 linspace, the obvious shortcut, is not the same rule
    assert differs_from_float64 > 100


def test_short_videos() -> None:
    rule = VideoTokenRule()
    # fewer frames than min_frames: qwen-vl-utils takes the even number of frames the video has
    assert rule.num_frames(3, 25.0) == 2
    assert rule.num_frames(5, 25.0) == 4
    assert rule.num_frames(7, 1.0) == 6  # 14 wanted at 2 fps, bounded by the frames there are
    for total in (0, 1):
        with pytest.raises(VideoRuleError) as info:
            rule.num_frames(total, 25.0)
        assert info.value.reason == "video_too_short"


def test_long_video_is_capped_at_max_frames_and_total_pixels() -> None:
    rule = VideoTokenRule()
    plan = rule.plan(VideoMeta(total_frames=90_000, fps=30.0, width=1920, height=1080, duration_s=3000.0))
    assert len(plan.frame_indices) == 768 and plan.grid_thw[0] == 384
    # 768 frames share 128000*28*28*0.9 pixels two by two: 235,200 per frame, below 768*28*28
    h, w = plan.resized_hw
    assert rule.frame_max_pixels(768) == pytest.approx(235_200)
    assert (h, w) == (336, 644) and h * w <= 235_200
    assert plan.frame_indices[0] == 0 and plan.frame_indices[-1] == 89_999


def test_rejects_and_validation() -> None:
    rule = VideoTokenRule()
    with pytest.raises(VideoRuleError) as info:
        rule.resized_hw(10, 2500, 4)
    assert info.value.reason == "video_aspect_ratio"
    with pytest.raises(ValueError, match="--video-fps"):
        VideoTokenRule(fps=0)
    with pytest.raises(ValueError, match="--video-min-frames"):
        VideoTokenRule(min_frames=10, max_frames=4)
    with pytest.raises(ValueError, match="--video-min-pixels"):
        VideoTokenRule(min_pixels=1000, max_pixels=10)
    with pytest.raises(ValueError, match="--video-total-pixels"):
        VideoTokenRule(total_pixels=0)
    with pytest.raises(ValueError):
        VideoMeta(total_frames=10, fps=0.0, width=10, height=10, duration_s=1.0)


def test_rule_and_plan_round_trip() -> None:
    rule = VideoTokenRule(fps=1.0, max_frames=32)
    assert VideoTokenRule.from_dict(json.loads(json.dumps(rule.to_dict()))) == rule
    plan = rule.plan(VideoMeta(total_frames=301, fps=29.97, width=333, height=201, duration_s=10.04))
    assert VideoPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert plan.num_tokens == rule.tokens_of_grid(plan.grid_thw)


def test_temporal_positions_equal_transformers() -> None:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    from mmpack.packing.video_tokens import video_temporal_positions

    rule = VideoTokenRule()
    rng = np.random.default_rng(3)
    cases = [
        (int(rng.integers(2, 20_000)), float(rng.choice([23.976, 25.0, 29.97, 30.0, 59.94])))
        for _ in range(300)
    ]
    cases += [(243, 25.0), (270, 359 / 12), (146, 24000 / 1001)]
    truncated_differently = 0
    for total, fps in cases:
        plan = rule.plan(
            VideoMeta(total_frames=total, fps=fps, width=640, height=360, duration_s=total / fps)
        )
        t = plan.grid_thw[0]
        for tokens_per_second in (2, 25):
            # the processor hands second_per_grid_ts over as a float32 tensor
            interval = tokens_per_second * torch.tensor([plan.second_per_grid_t])[0]
            theirs = Qwen2_5_VLModel.get_vision_position_ids(None, 7, torch.tensor([t, 2, 2]), 1, 2, interval)  # type: ignore[arg-type]
            ours = video_temporal_positions(t, plan.second_per_grid_t, tokens_per_second)
            np.testing.assert_array_equal(ours + 7, theirs[0].numpy())
            exact = np.floor(np.arange(t) * tokens_per_second * plan.second_per_grid_t).astype(np.int64)
            truncated_differently += not np.array_equal(exact, ours)
    # control: float64 arithmetic would give other positions for some videos
    assert truncated_differently > 0


@pytest.mark.shared
def test_demo_records_video_pads_with_the_qwen3_tokenizer(qwen3_tokenizer_path) -> None:
    """Each demo video's <video> tag expanded to its planned <|video_pad|> run stays one token per pad."""
    from tokenizers import Tokenizer

    from mmpack.offline_packing.inputs.video_probe import probe_video

    records = DEMO_DIR / "mllm_video_demo.json"
    need_shared(records, what="the video demo")
    tokenizer = Tokenizer.from_file(str(qwen3_tokenizer_path))
    video_pad = tokenizer.token_to_id("<|video_pad|>")
    assert video_pad is not None and tokenizer.token_to_id("<|image_pad|>") != video_pad
    for rec in json.loads(records.read_text()):
        meta = probe_video(DEMO_DIR / rec["videos"][0]).meta
        plan = VideoTokenRule().plan(meta)
        ref = qwen_vl_video_plan(meta.total_frames, meta.fps, meta.height, meta.width)
        assert ref is not None
        expanded = "<|vision_start|>" + "<|video_pad|>" * plan.num_tokens + "<|vision_end|>"
        text = rec["messages"][0]["content"].replace("<video>", expanded)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids.count(video_pad) == plan.num_tokens == ref["tokens"]
        vision_start = tokenizer.token_to_id("<|vision_start|>")
        assert vision_start is not None
        start = ids.index(vision_start)
        assert ids[start + 1 + plan.num_tokens] == tokenizer.token_to_id("<|vision_end|>")
