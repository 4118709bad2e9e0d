"""The LLaVA-OneVision-2 video rule (its `LlavaOnevision2VideoProcessor` and `Llava_Onevision2Processor`, as
`Llava_Onevision2Processor.from_pretrained` builds them): frames sampled, frame size, and one block of tokens
per frame; `VideoTokenRule(style="llava_onevision2")` applies it (`VIDEO_STYLE`), and a model folder whose
`config.json` model_type is one of `MODEL_TYPES` selects it.

    duration = total / video_fps
    nframes  = 8 below 10 s, 16 below 30 s, else max_frames; at most total (then every frame)
    indices  = round(torch float32 linspace(0, total - 1, nframes))
    h1, w1   = smart_resize(h, w, factor = patch * merge, min_pixels, max_pixels)   (the video processor's
               own bounds, 256*28*28 and 1605632 unless set: sides first at least `factor`)
    h', w'   = the image rule's resize of an h1 x w1 frame (each frame then goes through the image processor)
    grid     = (nframes, h' / patch, w' / patch)            (temporal patch 1: one frame, one grid step)
    seconds  = index / video_fps, written "MM:SS.ffffff" and read back (the processor's round trip)

The processor replaces the chat template's ``<|vision_start|><|video_pad|><|vision_end|>`` by, per frame,
``<{seconds:.1f} seconds><|vision_start|>`` + h' w' / merge^2 ``<|image_pad|>`` + ``<|vision_end|>`` (no
separator): the model sees each frame as an image with t = 1.

A video given as codec canvases (a `cv-preinfer` folder) follows the same processor's codec path instead
(`mmpack.packing.video_codec_ov2`: one grid row for its canvases, one timestamped block per run of equal source
frame); its plan holds `run_tokens`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mmpack.packing import video_codec_ov2 as codec
from mmpack.packing.image_tokens import ImageTokenRule, read_processor_config, smart_resize
from mmpack.packing.video_codec_ov2 import timestamp_text
from mmpack.packing.video_style import FolderClaim, VideoRuleError, VideoStyle, sample_frame_indices

STYLE = "llava_onevision2"
# the config.json model types whose processor writes these video blocks (such a folder selects this rule)
MODEL_TYPES = ("llava_onevision2", "llava_onevision2_moe")
# `LlavaOnevision2VideoProcessor`'s defaults, which `from_pretrained` keeps (transformers 5's image processor
# has no `min_pixels` / `max_pixels` attributes for it to take)
MAX_FRAMES = 384
MIN_PIXELS = 256 * 28 * 28
MAX_PIXELS = 1605632


def num_frames(total_frames: int, video_fps: float, *, max_frames: int) -> int:
    """Frames sampled from a video (`choose_target_frames` by duration, then all frames if fewer)."""
    duration = total_frames / video_fps
    wanted = 8 if duration < 10 else 16 if duration < 30 else max_frames
    return min(wanted, total_frames)


def resized_hw(
    height: int, width: int, *, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int,
    image_min_pixels: int, image_max_pixels: int,
) -> tuple[int, int]:  # fmt: skip
    """(h', w') of every sampled frame: the video processor's resize, then the image processor's
    (`mmpack.packing.image_tokens.ImageSizeError` where that refuses the frame; ValueError for an empty one)."""
    factor = patch_size * merge_size
    h1, w1 = smart_resize(
        height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels, video=True
    )
    if h1 < 1 or w1 < 1:
        raise ValueError(f"the video processor's resize leaves a {w1}x{h1} (w x h) frame")
    image = ImageTokenRule(
        patch_size=patch_size, merge_size=merge_size, temporal_patch_size=1, min_pixels=image_min_pixels,
        max_pixels=image_max_pixels,
    )  # fmt: skip
    return image.resized_hw(h1, w1)


def frame_seconds(index: int, video_fps: float) -> float:
    """A frame's time as the processor holds it: index / fps through its "MM:SS.ffffff" text."""
    seconds = index / video_fps
    minutes = int(seconds // 60)
    return minutes * 60 + float(f"{seconds - minutes * 60:09.6f}")


def block_ids(tokenizer: Any, plan: Any) -> np.ndarray:
    """The ids that replace a video's ``<|vision_start|><|video_pad|><|vision_end|>`` (see the module
    docstring; `tokenizer`: a `mmpack.packing.tokenizer.TextTokenizer`, `plan`: a
    `mmpack.packing.video_tokens.VideoPlan` of this rule).

    Each timestamp text is encoded alone: it sits between special tokens, or after the text before the video,
    which the packer checks does not merge with it (else it rejects the sample: `video_timestamp_merge`)."""
    ids = tokenizer.special_ids
    per_frame = plan.num_tokens // plan.grid_thw[0]
    frame = [ids["vision_start"], *[ids["image_pad"]] * per_frame, ids["vision_end"]]
    out = [tokenizer.encode(timestamp_text(t)) + frame for t in plan.timestamps_s]
    return np.asarray([i for part in out for i in part], dtype=np.uint32)


class OneVision2Style(VideoStyle):
    """LLaVA-OneVision-2's processor (see the module docstring): each frame an image to the model."""

    name = STYLE
    frames_as_images = True
    image_bounds = True
    whole_block = True
    with_images = False  # its processor gives such a sample other ids and pixels than its text says
    # its video processor's constructor arguments; the other --video-* flags are refused
    options = ("max_frames", "min_pixels", "max_pixels")
    options_note = "samples 8, 16 or --video-max-frames frames by duration (LLaVA-OneVision-2's processor)"

    def check(self, rule: Any) -> None:
        if rule.temporal_patch_size != 1 or min(rule.image_min_pixels, rule.image_max_pixels) < 1:
            raise ValueError(
                f"the {STYLE} video rule needs temporal_patch_size 1 and the image rule's pixel bounds, got "
                f"{rule.temporal_patch_size}, {rule.image_min_pixels}, {rule.image_max_pixels}"
            )

    def num_frames(self, rule: Any, total_frames: int, video_fps: float) -> int:
        return num_frames(total_frames, video_fps, max_frames=rule.max_frames)

    def frame_indices(self, rule: Any, total_frames: int, nframes: int) -> Sequence[int]:
        return sample_frame_indices(total_frames, nframes).tolist()

    def resized_hw(self, rule: Any, height: int, width: int, nframes: int) -> tuple[int, int]:
        try:
            return resized_hw(
                height, width, patch_size=rule.patch_size, merge_size=rule.merge_size,
                min_pixels=rule.min_pixels, max_pixels=rule.max_pixels, image_min_pixels=rule.image_min_pixels,
                image_max_pixels=rule.image_max_pixels,
            )  # fmt: skip
        except ValueError as exc:
            raise VideoRuleError("video_too_small", f"video of {width}x{height} (w x h): {exc}") from None

    def timestamps(self, rule: Any, indices: Sequence[int], video_fps: float) -> tuple[float, ...]:
        return tuple(frame_seconds(i, video_fps) for i in indices)

    def token_ids(self, tokenizer: Any, plan: Any) -> np.ndarray | None:
        return codec.block_ids(tokenizer, plan) if plan.run_tokens else block_ids(tokenizer, plan)

    def trailing_text(self, plan: Any) -> str:
        return codec.NEWLINE if plan.run_tokens else ""

    def codec_plan_fields(self, rule: Any, codec_summary: Mapping[str, Any]) -> dict[str, Any]:
        try:
            return codec.plan_fields(codec_summary, patch_size=rule.patch_size, merge_size=rule.merge_size)
        except codec.CodecAssetError as exc:
            raise VideoRuleError("codec_video", exc.message) from None

    def leading_text(self, plan: Any) -> str:
        return timestamp_text(plan.timestamps_s[0])

    def rule_fields(self, given: Mapping[str, Any], image_rule: ImageTokenRule) -> dict[str, Any]:
        fields = {
            "max_frames": MAX_FRAMES, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, **given,
            "image_min_pixels": image_rule.min_pixels, "image_max_pixels": image_rule.max_pixels,
        }  # fmt: skip
        fields["min_frames"] = min(fields["max_frames"], 4)  # unused here; kept valid for any max_frames
        return fields

    def claim(self, folder: str) -> FolderClaim | None:
        found = read_processor_config(folder, "config.json")
        if found is None or found[1].get("model_type") not in MODEL_TYPES:
            return None
        return FolderClaim(f"--model {folder}")


VIDEO_STYLE = OneVision2Style()
