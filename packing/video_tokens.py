"""Video-token rule: the frames sampled from a video, their size, grid and tokens, planned from container metadata.

The offline packer plans each video from its container metadata (`VideoMeta`, read by
`mmpack.offline_packing.inputs.video_probe`) with `VideoTokenRule.plan`; the loader decodes exactly the frames of that
plan (`mmpack.dataloader.video`). No frame is decoded to count tokens. A rule is its numbers (the fields of
`VideoTokenRule`) and its `style`, the name of a `mmpack.packing.video_style.VideoStyle` in the registry
(`mmpack.packing.video_rules`) that decides frame count, frame indices, frame size and timestamps; every plan
then has

    grid     = (ceil(nframes / temporal_patch_size), h' / patch, w' / patch)   tokens = t * h * w / merge^2
    sample_fps = nframes / total * video_fps;  second_per_grid_t = temporal_patch_size / sample_fps

The styles (one module each):

- `"qwen-vl-utils"` (default, `mmpack.packing.video_tokens_qwen2`): qwen-vl-utils 0.0.14 with the `fps` sampling
  mode. Defaults are its constants for patch 14: min_pixels 128*28*28, max_pixels 768*28*28, total_pixels
  MODEL_SEQ_LEN*28*28*0.9 with MODEL_SEQ_LEN 128000 (qwen-vl-utils reads that environment variable; here it is
  the `total_pixels` field, never the environment).
- `"qwen3_vl"` (`mmpack.packing.video_tokens_qwen3`): transformers' Qwen3-VL processor, a timestamp before each
  temporal patch (`VideoPlan.timestamps_s`).
- `"llava_onevision2"` (`mmpack.packing.video_tokens_ov2`): LLaVA-OneVision-2's processor, `image_min_pixels` /
  `image_max_pixels` (the image rule's) for the image processor every frame goes through, a timestamp before
  each frame, and `<|image_pad|>` tokens (each frame is an image to the model).

Where `total` comes from duration x frame rate (containers without a frame count), frame k is the frame shown at
time k / video_fps (see `VideoMeta.frame_count_exact`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mmpack.packing.video_rules import DEFAULT_STYLE, video_style
from mmpack.packing.video_style import VideoMeta, VideoRuleError, VideoStyle, sample_frame_indices

__all__ = [
    "VideoMeta",
    "VideoPlan",
    "VideoRuleError",
    "VideoTokenRule",
    "sample_frame_indices",
    "video_temporal_positions",
]


@dataclass(kw_only=True, frozen=True)
class VideoPlan:
    """The frames and size one video is trained with, as recorded per video in a packed record."""

    frame_indices: tuple[int, ...]
    resized_hw: tuple[int, int]
    grid_thw: tuple[int, int, int]
    num_tokens: int
    sample_fps: float
    second_per_grid_t: float
    frame_count_exact: bool
    video_fps: float
    timestamps_s: tuple[float, ...] = ()  # per temporal patch, where the rule writes them (qwen3_vl, OV-2)
    # a codec-stream video (`mmpack.packing.video_codec_ov2`): the <|image_pad|> count of each run of equal
    # source frame; frame_indices and timestamps_s are then per run, grid_thw is the canvases' one row
    run_tokens: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (lists, not tuples; no timestamps where the rule writes none)."""
        d = asdict(self)
        d["frame_indices"] = list(self.frame_indices)
        d["resized_hw"] = list(self.resized_hw)
        d["grid_thw"] = list(self.grid_thw)
        if self.timestamps_s:
            d["timestamps_s"] = list(self.timestamps_s)
        else:
            del d["timestamps_s"]
        if self.run_tokens:
            d["run_tokens"] = list(self.run_tokens)
        else:
            del d["run_tokens"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VideoPlan:
        """Inverse of `to_dict`."""
        return cls(
            frame_indices=tuple(int(i) for i in d["frame_indices"]),
            resized_hw=(int(d["resized_hw"][0]), int(d["resized_hw"][1])),
            grid_thw=(int(d["grid_thw"][0]), int(d["grid_thw"][1]), int(d["grid_thw"][2])),
            num_tokens=int(d["num_tokens"]),
            sample_fps=float(d["sample_fps"]),
            second_per_grid_t=float(d["second_per_grid_t"]),
            frame_count_exact=bool(d["frame_count_exact"]),
            video_fps=float(d["video_fps"]),
            timestamps_s=tuple(float(t) for t in d.get("timestamps_s", ())),
            run_tokens=tuple(int(n) for n in d.get("run_tokens", ())),
        )


@dataclass(kw_only=True, frozen=True)
class VideoTokenRule:
    """Frame sampling and sizing of videos: the numbers, and the `style` that applies them (see the module
    docstring; defaults are qwen-vl-utils 0.0.14's)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    total_pixels: float = 128000 * 28 * 28 * 0.9
    frame_factor: int = 2
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    max_aspect_ratio: float = 200
    style: str = DEFAULT_STYLE  # whose rule: a name in `mmpack.packing.video_rules.VIDEO_RULES`
    image_min_pixels: int = 0  # styles with `image_bounds` only: the image rule's bounds, every frame's too
    image_max_pixels: int = 0

    def __post_init__(self) -> None:
        kind = video_style(self.style)
        if not self.fps > 0:
            raise ValueError(f"video fps must be > 0, got {self.fps} (--video-fps)")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(
                f"need 1 <= min_frames <= max_frames, got {self.min_frames}, {self.max_frames} "
                "(--video-min-frames, --video-max-frames)"
            )
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"need 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels} "
                "(--video-min-pixels, --video-max-pixels)"
            )
        if not self.total_pixels > 0:
            raise ValueError(
                f"video total_pixels must be > 0, got {self.total_pixels} (--video-total-pixels)"
            )
        if min(self.frame_factor, self.patch_size, self.merge_size, self.temporal_patch_size) < 1:
            raise ValueError("frame_factor, patch_size, merge_size and temporal_patch_size must be >= 1")
        if self.frame_factor % self.temporal_patch_size:
            raise ValueError(
                f"frame_factor {self.frame_factor} must be a multiple of temporal_patch_size "
                f"{self.temporal_patch_size}: frames are grouped in temporal patches"
            )
        kind.check(self)
        if kind.frames_as_images and self.temporal_patch_size != 1:  # a frame is one image: one grid step
            raise ValueError(
                f"the {self.style} video rule hands frames to the tower as images: it needs temporal_patch_size "
                f"1, got {self.temporal_patch_size}"
            )

    @property
    def kind(self) -> VideoStyle:
        """The style object of `style` (the registry's)."""
        return video_style(self.style)

    @property
    def factor(self) -> int:
        """Side granularity in pixels: one merged token covers factor x factor pixels of a frame pair."""
        return self.patch_size * self.merge_size

    def num_frames(self, total_frames: int, video_fps: float) -> int:
        """Frames sampled from a video of `total_frames` at `video_fps`."""
        return int(self.kind.num_frames(self, total_frames, video_fps))

    def frame_max_pixels(self, nframes: int) -> float:
        """qwen-vl-utils' per-frame pixel cap for `nframes` sampled frames (the total-pixel budget they share)."""
        from mmpack.packing.video_tokens_qwen2 import frame_max_pixels

        return frame_max_pixels(self, nframes)

    def resized_hw(self, height: int, width: int, nframes: int) -> tuple[int, int]:
        """(h', w') every sampled frame is resized to."""
        h_bar, w_bar = self.kind.resized_hw(self, height, width, nframes)
        return int(h_bar), int(w_bar)

    def plan(self, meta: VideoMeta) -> VideoPlan:
        """Frames, size, grid and tokens of a video from its container metadata."""
        kind = self.kind
        nframes = self.num_frames(meta.total_frames, meta.fps)
        h_bar, w_bar = self.resized_hw(meta.height, meta.width, nframes)
        indices = [int(i) for i in kind.frame_indices(self, meta.total_frames, nframes)]
        self._check_style_plan(meta, nframes, indices, (h_bar, w_bar))
        tp = self.temporal_patch_size
        grid = (-(-nframes // tp), h_bar // self.patch_size, w_bar // self.patch_size)
        sample_fps = nframes / max(meta.total_frames, 1e-6) * meta.fps
        return VideoPlan(
            frame_indices=tuple(indices),
            resized_hw=(h_bar, w_bar),
            grid_thw=grid,
            num_tokens=self.tokens_of_grid(grid),
            sample_fps=sample_fps,
            second_per_grid_t=tp / sample_fps,
            frame_count_exact=meta.frame_count_exact,
            video_fps=meta.fps,
            timestamps_s=tuple(float(t) for t in kind.timestamps(self, indices, meta.fps)),
        )

    def plan_codec(self, codec: dict[str, Any]) -> VideoPlan:
        """The plan of a codec-stream video from the scan's summary of its canvases
        (`mmpack.packing.video_codec_ov2.codec_summary`); VideoRuleError where the style reads none."""
        return VideoPlan(**self.kind.codec_plan_fields(self, codec))

    def _check_style_plan(
        self, meta: VideoMeta, nframes: int, indices: list[int], size_hw: tuple[int, int]
    ) -> None:
        """ValueError where the style's plan breaks what the loader and the tower rely on: one index per frame,
        each a frame of the video, and a frame size of whole merged patches."""
        h, w = size_hw
        if len(indices) != nframes or not all(0 <= i < max(meta.total_frames, 1) for i in indices):
            raise ValueError(
                f"video rule {self.style}: {len(indices)} frame indices for {nframes} frames of a "
                f"{meta.total_frames}-frame video: {indices[:8]}..."
            )
        if min(h, w) < self.factor or h % self.factor or w % self.factor:
            raise ValueError(
                f"video rule {self.style}: frame size {w}x{h} (w x h) is not whole {self.factor}-pixel blocks"
            )

    def tokens_of_grid(self, grid_thw: tuple[int, int, int]) -> int:
        """LLM tokens (<|video_pad|> count) of a vision grid (t, h, w) in patches."""
        t, gh, gw = grid_thw
        return int(t * gh * gw) // (self.merge_size**2)

    def to_dict(self) -> dict[str, Any]:
        """The manifest's "video_rule" entry; `style` only where it is not the default (the rule of the
        manifests written before there was a choice), the image bounds only where the style holds them."""
        d = asdict(self)
        if not self.kind.image_bounds:
            del d["image_min_pixels"], d["image_max_pixels"]
        if self.style == DEFAULT_STYLE:
            del d["style"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VideoTokenRule:
        """The rule of a manifest's "video_rule" entry (unknown keys are an error, missing ones default)."""
        return cls(**d)


def video_temporal_positions(grid_t: int, second_per_grid_t: float, tokens_per_second: float) -> np.ndarray:
    """MRoPE temporal offsets of a video's temporal patches: int64 [grid_t], before adding the start position.

    As Qwen2.5-VL's `get_rope_index` in transformers computes them from the float32 `second_per_grid_ts`
    its processor returns: interval = float32(tokens_per_second * second_per_grid_t), offsets =
    trunc(float32(i * interval)). (Qwen2-VL, without `second_per_grid_ts`, is the interval 1 case.)
    """
    interval = np.float32(tokens_per_second) * np.float32(second_per_grid_t)
    return (np.arange(grid_t, dtype=np.float32) * interval).astype(np.int64)
