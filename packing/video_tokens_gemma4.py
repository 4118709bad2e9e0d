"""The Gemma 4 video rule (transformers' `Gemma4VideoProcessor` and `Gemma4Processor`): frames sampled, their size,
and one timestamped block of tokens per frame; `VideoTokenRule(style="gemma4")` applies it (`VIDEO_STYLE`), and
a model folder whose video processor config names `Gemma4VideoProcessor` selects it.

    nframes  = num_frames (the config's; `max_frames` here), refused where the video has fewer frames
    indices  = k * total // nframes for k = 0 .. nframes - 1
    h', w'   = the Gemma 4 image resize (`mmpack.packing.image_tokens_gemma4.budget_resize`) of the frame size
               under the video processor's own `max_soft_tokens` (`max_pixels` = max_soft_tokens x factor^2)
    grid     = (nframes, h' / patch, w' / patch)        tokens per frame = h' w' / factor^2
    seconds  = index / video_fps, written MM:SS (whole minutes and whole seconds, two digits each)

The chat template writes one ``<|video|>`` per video; the processor replaces it by, per frame,
``MM:SS <|image>`` + tokens x ``<|video|>`` + ``<image|>``, the frames joined by one space.
transformers' video processor resizes the decoded frames with torchvision (antialiased bicubic on tensors);
mmpack's loader decodes with PyAV and resizes with PIL, so the token counts are the processor's while the
pixels may differ from it by a few levels (docs/families.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mmpack.packing.image_tokens import PROCESSOR_CONFIG, ImageTokenRule, read_processor_config
from mmpack.packing.image_tokens_gemma4 import (
    BOI,
    EOI,
    POOLING_KERNEL_SIZE,
    SOFT_TOKEN_BUDGETS,
    VIDEO_SOFT,
    budget_resize,
    media_ids,
)
from mmpack.packing.tokenizer import ControlTokens
from mmpack.packing.video_style import FolderClaim, VideoRuleError, VideoStyle

STYLE = "gemma4"
PROCESSOR_TYPES = ("Gemma4VideoProcessor",)
# what a video's text needs (`block_ids`), whichever image rule the job has
CONTROL_TOKENS = ControlTokens(
    "gemma4 video", required=(("image_start", BOI), ("video_pad", VIDEO_SOFT), ("image_end", EOI))
)
# `Gemma4VideoProcessor`'s class defaults, which a config without the key keeps
NUM_FRAMES = 32
MAX_SOFT_TOKENS = 70
PATCH_SIZE = 16


def frame_indices(total_frames: int, nframes: int) -> list[int]:
    """The sampled frames: `nframes` evenly spaced from frame 0, each k * total // nframes."""
    return [k * total_frames // nframes for k in range(nframes)]


def timestamp_text(seconds: float) -> str:
    """A frame's time as the processor writes it: MM:SS, whole minutes and whole seconds."""
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes):02d}:{int(rest):02d}"


def block_ids(tokenizer: Any, plan: Any) -> np.ndarray:
    """The ids that replace a video's placeholder (see the module docstring; `tokenizer`: a
    `mmpack.packing.tokenizer.TextTokenizer`, `plan`: a `VideoPlan` of this rule).

    Each frame's text is encoded on its own: it starts after a special token (``<image|>``) or after the text
    before the video, which the packer checks does not merge with the first timestamp (`leading_text`)."""
    per_frame = plan.num_tokens // plan.grid_thw[0]
    soft = media_ids(tokenizer, VIDEO_SOFT, 1)
    out: list[int] = []
    for k, seconds in enumerate(plan.timestamps_s):
        text = f"{' ' if k else ''}{timestamp_text(seconds)} "
        out += tokenizer.encode(text) + soft[:1] + [soft[1]] * per_frame + soft[2:]
    return np.asarray(out, dtype=np.uint32)


class Gemma4VideoStyle(VideoStyle):
    """Gemma 4's video processor (see the module docstring)."""

    name = STYLE
    whole_block = True
    control_tokens = CONTROL_TOKENS
    options = ("max_frames", "max_pixels")
    options_note = (
        "samples num_frames frames (--video-max-frames) at --video-max-pixels (Gemma 4's processor)"
    )

    def check(self, rule: Any) -> None:
        factor = rule.factor
        budget = rule.max_pixels // (factor * factor)
        if rule.temporal_patch_size != 1 or rule.max_pixels != budget * factor * factor:
            raise ValueError(
                f"the {STYLE} video rule needs temporal_patch_size 1 and max_pixels = max_soft_tokens x {factor}^2, "
                f"got {rule.temporal_patch_size}, {rule.max_pixels}"
            )

    def num_frames(self, rule: Any, total_frames: int, video_fps: float) -> int:
        if total_frames < rule.max_frames:
            raise VideoRuleError(
                "video_too_short",
                f"{total_frames} frames, fewer than the {rule.max_frames} the {STYLE} rule samples (num_frames)",
            )
        return int(rule.max_frames)

    def frame_indices(self, rule: Any, total_frames: int, nframes: int) -> Sequence[int]:
        return frame_indices(total_frames, nframes)

    def resized_hw(self, rule: Any, height: int, width: int, nframes: int) -> tuple[int, int]:
        factor = rule.factor
        try:
            return budget_resize(
                height, width, factor=factor, max_soft_tokens=rule.max_pixels // (factor * factor)
            )
        except ValueError as exc:
            raise VideoRuleError("video_too_small", f"video of {width}x{height} (w x h): {exc}") from None

    def timestamps(self, rule: Any, indices: Sequence[int], video_fps: float) -> tuple[float, ...]:
        return tuple(i / video_fps for i in indices)

    def token_ids(self, tokenizer: Any, plan: Any) -> np.ndarray | None:
        return block_ids(tokenizer, plan)

    def leading_text(self, plan: Any) -> str:
        return f"{timestamp_text(plan.timestamps_s[0])} "

    def rule_fields(self, given: Mapping[str, Any], image_rule: ImageTokenRule) -> dict[str, Any]:
        factor = image_rule.factor
        fields = {"max_frames": NUM_FRAMES, "max_pixels": MAX_SOFT_TOKENS * factor * factor, **given}
        return {**fields, "min_frames": 1, "min_pixels": min(factor * factor, fields["max_pixels"])}

    def claim(self, folder: str) -> FolderClaim | None:
        found = read_processor_config(folder, PROCESSOR_CONFIG)
        config = found[1].get("video_processor") if found else None
        if not isinstance(config, dict) or config.get("video_processor_type") not in PROCESSOR_TYPES:
            return None
        source = f"{found[0]} video_processor" if found else PROCESSOR_CONFIG
        return FolderClaim(source, claim_fields(config, source), fixed=True)


def claim_fields(config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The `VideoTokenRule` fields (patch sizes included, for the check against the image rule) of a
    `Gemma4VideoProcessor` config; ValueError naming `source` for settings the rule does not follow."""
    if config.get("do_sample_frames", True) is not True or config.get("fps") is not None:
        raise ValueError(f"{source}: mmpack follows the num_frames sampling (do_sample_frames true, no fps)")
    try:
        patch = int(config.get("patch_size", PATCH_SIZE))
        pooling = int(config.get("pooling_kernel_size", POOLING_KERNEL_SIZE))
        budget = int(config.get("max_soft_tokens", MAX_SOFT_TOKENS))
        frames = int(config.get("num_frames", NUM_FRAMES))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from None
    if budget not in SOFT_TOKEN_BUDGETS or frames < 1:
        raise ValueError(f"{source}: max_soft_tokens must be one of {SOFT_TOKEN_BUDGETS} and num_frames >= 1")
    factor = patch * pooling
    return {
        "patch_size": patch,
        "merge_size": pooling,
        "temporal_patch_size": 1,
        "max_frames": frames,
        "max_pixels": budget * factor * factor,
    }


VIDEO_STYLE = Gemma4VideoStyle()
__all__ = ["BOI", "EOI", "VIDEO_SOFT", "VIDEO_STYLE", "block_ids", "frame_indices", "timestamp_text"]
