"""A fake video rule that only the registry knows (tests/test_video_rule_registry.py): a fixed number of frames
(`min_frames`, rounded down to whole temporal patches) taken from the last frame backwards, each resized to a
square of two merged patches a side, no timestamps. Registered by one line, `register(VIDEO_RULES)`."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

from mmpack.packing.video_style import VideoRuleError, VideoStyle

FAKE_STYLE = "test_backwards_frames"
MODULE = "tests.support.fake_video_rule"  # this module's import name (also when a rank runs a script)


class BackwardsFramesStyle(VideoStyle):
    """Frames from the end backwards at a fixed small size: nothing like any real processor's rule, so a
    loader or packer that ignored the registry would show."""

    name = FAKE_STYLE

    def num_frames(self, rule: Any, total_frames: int, video_fps: float) -> int:
        n = rule.min_frames - rule.min_frames % rule.temporal_patch_size
        if n < 1 or total_frames < n:
            raise VideoRuleError("video_too_short", f"{total_frames} frames, {FAKE_STYLE} takes {n}")
        return n

    def frame_indices(self, rule: Any, total_frames: int, nframes: int) -> Sequence[int]:
        step = (total_frames - 1) / max(nframes - 1, 1)
        return [total_frames - 1 - round(k * step) for k in range(nframes)]

    def resized_hw(self, rule: Any, height: int, width: int, nframes: int) -> tuple[int, int]:
        return 2 * rule.factor, 2 * rule.factor


VIDEO_STYLE = BackwardsFramesStyle()


def register(registry: MutableMapping[str, str]) -> None:
    """Add the fake to a video-rule registry (`mmpack.packing.video_rules.VIDEO_RULES`)."""
    registry[FAKE_STYLE] = MODULE
