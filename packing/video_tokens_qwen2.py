"""The qwen-vl-utils 0.0.14 video rule (`vision_process.py`, Qwen2-VL / Qwen2.5-VL), the default style
`"qwen-vl-utils"`, as qwen-vl-utils applies it with the `fps` sampling mode::

    nframes  = total / video_fps * fps, clamped to [ceil2(min_frames), floor2(min(max_frames, total))],
               then to at most total, then floored to a multiple of frame_factor (2); at least 2 or reject
    indices  = round(linspace(0, total - 1, nframes))          (torch float32 linspace, round half to even)
    max_px   = max(min(max_pixels, total_pixels / nframes * frame_factor), int(min_pixels * 1.05))
    h', w'   = smart_resize(h, w, factor=28, min_pixels, max_px)       (multiples of 28)

No model folder selects it: it is the rule without one (the --video-* flags set its numbers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mmpack.packing.image_tokens import smart_resize
from mmpack.packing.video_style import VideoRuleError, VideoStyle, sample_frame_indices


def frame_max_pixels(rule: Any, nframes: int) -> float:
    """Per-frame pixel cap for `nframes` sampled frames (the total-pixel budget shared by the frames)."""
    shared = rule.total_pixels / nframes * rule.frame_factor
    return max(min(rule.max_pixels, shared), int(rule.min_pixels * 1.05))


class QwenVlUtilsStyle(VideoStyle):
    """qwen-vl-utils' `smart_nframes`, linspace sampling and `smart_resize` for videos; no timestamps."""

    name = "qwen-vl-utils"

    def num_frames(self, rule: Any, total_frames: int, video_fps: float) -> int:
        ff = rule.frame_factor
        min_frames = math.ceil(rule.min_frames / ff) * ff
        max_frames = math.floor(min(rule.max_frames, total_frames) / ff) * ff
        wanted = total_frames / video_fps * rule.fps
        nframes = min(max(wanted, min_frames), max_frames, total_frames)
        nframes = math.floor(nframes / ff) * ff
        if not ff <= nframes <= total_frames:
            raise VideoRuleError(
                "video_too_short",
                f"a video of {total_frames} frames gives {nframes} sampled frames; at least {ff} are needed",
            )
        return int(nframes)

    def frame_indices(self, rule: Any, total_frames: int, nframes: int) -> Sequence[int]:
        return sample_frame_indices(total_frames, nframes).tolist()

    def resized_hw(self, rule: Any, height: int, width: int, nframes: int) -> tuple[int, int]:
        factor = rule.factor
        aspect = max(height, width) / min(height, width)
        if aspect > rule.max_aspect_ratio:
            raise VideoRuleError(
                "video_aspect_ratio",
                f"video of {width}x{height} (w x h) has aspect ratio {aspect:.1f}, "
                f"above the limit of {rule.max_aspect_ratio}",
            )
        max_pixels = frame_max_pixels(rule, nframes)
        h_bar, w_bar = smart_resize(
            height, width, factor=factor, min_pixels=rule.min_pixels, max_pixels=max_pixels, video=True
        )
        if h_bar < factor or w_bar < factor:  # qwen-vl-utils would resize to an empty frame here
            raise VideoRuleError(
                "video_too_small",
                f"video of {width}x{height} (w x h) is too elongated for {max_pixels:.0f} pixels per frame: "
                f"a side would shrink below {factor} pixels",
            )
        return h_bar, w_bar


VIDEO_STYLE = QwenVlUtilsStyle()
