"""The packer's Qwen3-VL token rules against transformers' Qwen3-VL processing (tests/support/qwen3_vl_reference.py says
which parts are transformers' code and which are harness): image counts on 250+ sizes covering the range,
video frames, grids and the timestamped token sequence on the real demo videos and on random metadata, and
the MRoPE positions of such a sequence against `Qwen3VLModel.get_rope_index`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack.packing.image_tokens import ImageSizeError, ImageTokenRule
from mmpack.packing.video_tokens import VideoMeta, VideoRuleError, VideoTokenRule
from mmpack.packing.video_tokens_qwen3 import placeholder_ids, rule_fields
from tests.support import qwen3_vl_reference as ref
from tests.support.qwen3_vl import SMALL_VIDEO_CONFIG  # the small video rule the parity tests pack with
from tests.support.shared import QWEN3_TOKENIZER, SHARED_DIR, need_shared

pytestmark = [pytest.mark.family]

VIDEO_DEMO = SHARED_DIR / "data" / "mllm_video_demo"


def _sizes() -> list[tuple[int, int]]:
    """(height, width): a log grid from 1 to 12000 pixels a side, camera and screen sizes, extreme aspects."""
    sides = np.unique(np.round(np.geomspace(1, 12000, 18)).astype(int)).tolist()
    sizes = [(h, w) for h in sides for w in sides]
    sizes += [(3024, 4032), (4032, 3024), (1080, 1920), (2160, 3840), (720, 1280), (480, 640), (512, 512)]
    sizes += [(1, 200), (1, 201), (10, 2000), (60, 11999), (33, 31), (31, 33), (32, 32), (16, 16), (47, 49)]
    return sizes


def _video_rule(config: dict) -> VideoTokenRule:
    return VideoTokenRule(**rule_fields(config, source="test"))


def test_image_tokens_equal_the_processor_over_the_size_range() -> None:
    """`mmpack pack --model DIR`'s rule (the folder's preprocessor_config.json) counts what transformers'
    Qwen3-VL image processor counts, on 250+ sizes; images it refuses are refused here too."""
    rule = ImageTokenRule.from_preprocessor_config(ref.IMAGE_CONFIG)
    processor = ref.image_processor()
    compared = differs_from_qwen25 = 0
    for h, w in _sizes():
        try:
            theirs = processor.get_number_of_image_patches(h, w, {}) // 4
        except ValueError:
            with pytest.raises(ImageSizeError):
                rule.num_tokens(h, w)
            continue
        assert rule.num_tokens(h, w) == theirs, (h, w)
        compared += 1
        differs_from_qwen25 += ImageTokenRule().num_tokens(h, w) != theirs
    assert compared >= 250
    assert differs_from_qwen25 > compared // 2  # control: Qwen2.5-VL's rule (patch 14) counts otherwise


def test_image_grids_equal_the_processor_on_decoded_pixels() -> None:
    """The processor's grids from real pixel arrays (not only its count) equal the rule's."""
    from PIL import Image

    rule = ImageTokenRule.from_preprocessor_config(ref.IMAGE_CONFIG)
    processor = ref.image_processor()
    rng = np.random.default_rng(0)
    for h, w in [(1, 200), (31, 33), (480, 640), (1080, 1920), (100, 3000)]:
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        grid = processor([image], return_tensors="np")["image_grid_thw"][0].tolist()
        assert tuple(grid) == rule.grid_thw(h, w), (h, w)


def _demo_videos() -> list:
    records = VIDEO_DEMO / "mllm_video_demo.json"
    need_shared(records, QWEN3_TOKENIZER, what="mllm_video_demo and the Qwen3 tokenizer")
    return [VIDEO_DEMO / rel for rec in json.loads(records.read_text()) for rel in rec["videos"]]


@pytest.mark.shared
@pytest.mark.parametrize("config", [ref.VIDEO_CONFIG, SMALL_VIDEO_CONFIG], ids=["qwen3_vl", "small"])
def test_video_tokens_equal_the_processor_on_the_real_videos(config: dict) -> None:
    """Frames, grid and the whole token sequence of a video sample (timestamps included) are the processor's."""
    from mmpack.offline_packing.inputs.video_probe import probe_video
    from mmpack.packing.chat import (
        Conversation,
        encode_texts,
        finish_tokenized,
        prepare_conversation,
        tokenize_conversation,
    )
    from mmpack.packing.tokenizer import load_tokenizer

    paths = _demo_videos()
    proc = ref.processor(QWEN3_TOKENIZER, config)
    tokenizer = load_tokenizer(QWEN3_TOKENIZER)
    rule = _video_rule(config)
    for path in paths:
        plan = rule.plan(probe_video(path).meta)
        theirs = ref.video_inputs(proc, path)
        assert list(plan.frame_indices) == theirs["frames"], path.name
        assert list(plan.grid_thw) == theirs["video_grid_thw"][0].tolist(), path.name
        conv = Conversation(messages=(("user", "<video>Why is it funny?"), ("assistant", "A baby reads.")),
                            videos=(str(path),))  # fmt: skip
        ours = tokenize_conversation(conv, tokenizer, [], None, [plan.num_tokens])
        prep = prepare_conversation(
            conv, tokenizer, [], None, [plan.num_tokens], [placeholder_ids(tokenizer, plan)]
        )
        [timed] = finish_tokenized([prep], tokenizer, encode_texts(tokenizer, [prep.text]))
        expected = ref.expand_text(proc, prep.text, [theirs])
        assert timed.input_ids.tolist() == expected, path.name
        assert (
            ours.input_ids.tolist() != expected
        )  # control: pads alone (no timestamps) are not the processor's
        assert int((timed.input_ids == tokenizer.special_ids["video_pad"]).sum()) == plan.num_tokens
        assert timed.loss_mask[timed.video_spans[0][0] : timed.video_spans[0][1]].sum() == 0


class _Metadata:
    """What `Qwen3VLVideoProcessor.sample_frames` reads of a `VideoMetadata`."""

    def __init__(self, total: int, fps: float) -> None:
        self.total_num_frames, self.fps = total, fps


@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(1, 60_000),
    fps=st.sampled_from([1.0, 8.0, 23.976023976023978, 25.0, 29.97, 30.0, 59.94, 120.0]),
    height=st.integers(1, 6000),
    width=st.integers(1, 6000),
    max_frames=st.sampled_from([8, 64, 768]),
    longest=st.sampled_from([50176 * 8, 786432, 25165824]),
)
def test_video_rule_equals_the_processor_on_random_metadata(
    total, fps, height, width, max_frames, longest
) -> None:
    config = {
        **ref.VIDEO_CONFIG,
        "max_frames": max_frames,
        "size": {"shortest_edge": 4096, "longest_edge": longest},
    }
    vp = ref.video_processing_module().Qwen3VLVideoProcessor(
        **{k: v for k, v in config.items() if k != "video_processor_type"}
    )
    rule = _video_rule(config)
    meta = VideoMeta(total_frames=total, fps=fps, width=width, height=height, duration_s=total / fps)
    indices = vp.sample_frames(_Metadata(total, fps))
    try:
        theirs = vp.get_num_of_video_patches(len(indices), height, width)
    except ValueError:
        with pytest.raises(VideoRuleError):
            rule.plan(meta)
        return
    plan = rule.plan(meta)
    assert list(plan.frame_indices) == indices.tolist()
    assert math.prod(plan.grid_thw) == theirs
    assert len(plan.timestamps_s) == plan.grid_thw[0]


def test_model_folder_gives_the_qwen3_video_rule_and_refuses_contradicting_flags(tmp_path) -> None:
    from mmpack.offline_packing.model_folder import resolve_video_rule

    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(SMALL_VIDEO_CONFIG))
    image = ImageTokenRule(patch_size=16, merge_size=2, temporal_patch_size=2)
    rule = resolve_video_rule(str(tmp_path), None, {}, image)
    assert rule.style == "qwen3_vl" and rule.max_frames == 8
    assert rule.max_pixels == 8 * 50176 and rule.min_pixels == 4096
    assert resolve_video_rule(str(tmp_path), None, {"video_max_frames": 8}, image) == rule  # agreeing flag
    with pytest.raises(ValueError, match="--video-max-frames 16 disagrees"):
        resolve_video_rule(str(tmp_path), None, {"video_max_frames": 16}, image)
    with pytest.raises(ValueError, match="--video-rule qwen-vl-utils disagrees"):
        resolve_video_rule(str(tmp_path), None, {"video_style": "qwen-vl-utils"}, image)
    with pytest.raises(ValueError, match="patch_size 16 differs from the image rule's 14"):
        resolve_video_rule(str(tmp_path), None, {}, ImageTokenRule(patch_size=14))
    # without a folder: qwen-vl-utils unless asked, and then the processor's defaults; patch sizes the image's
    assert resolve_video_rule(None, None, {}, image) == VideoTokenRule(patch_size=16)
    chosen = resolve_video_rule(None, None, {"video_style": "qwen3_vl"}, image)
    assert (chosen.min_pixels, chosen.max_pixels, chosen.patch_size) == (128 * 32 * 32, 32 * 32 * 768, 16)
    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps({**SMALL_VIDEO_CONFIG, "num_frames": 16})
    )
    with pytest.raises(ValueError, match="num_frames"):
        resolve_video_rule(str(tmp_path), None, {}, image)
