"""Video-token rule (qwen-vl-utils 0.0.14 `vision_process.py`): frames sampled, frame size, grid and tokens.

The offline packer plans each video from its container metadata (`VideoMeta`, read by
`mmpack.offline_packing.inputs.video_probe`) with `VideoTokenRule.plan`; the loader decodes exactly the frames of that
plan (`mmpack.dataloader.video`). No frame is decoded to count tokens. The rule, as qwen-vl-utils applies it with
the `fps` sampling mode and the Qwen2.5-VL patch size 14::

    nframes  = total / video_fps * fps, clamped to [ceil2(min_frames), floor2(min(max_frames, total))],
               then to at most total, then floored to a multiple of frame_factor (2); at least 2 or reject
    indices  = round(linspace(0, total - 1, nframes))          (torch float32 linspace, round half to even)
    max_px   = max(min(max_pixels, total_pixels / nframes * frame_factor), int(min_pixels * 1.05))
    h', w'   = smart_resize(h, w, factor=28, min_pixels, max_px)       (multiples of 28)
    grid     = (nframes / temporal_patch_size, h' / 14, w' / 14)   tokens = t * (h' / 28) * (w' / 28)
    sample_fps = nframes / total * video_fps;  second_per_grid_t = temporal_patch_size / sample_fps

Defaults are qwen-vl-utils' constants for patch 14: min_pixels 128*28*28, max_pixels 768*28*28,
total_pixels MODEL_SEQ_LEN*28*28*0.9 with MODEL_SEQ_LEN 128000 (qwen-vl-utils reads that environment
variable; here it is the `total_pixels` field, never the environment). Where `total` comes from
duration x frame rate (containers without a frame count), frame k is the frame shown at time k / video_fps
(see `VideoMeta.frame_count_exact`).

`style="qwen3_vl"` is the rule of transformers' Qwen3-VL processor instead (`mmpack.packing.video_tokens_qwen3`):
its own frame sampling and `smart_resize`, `min_pixels` / `max_pixels` being its `size.shortest_edge` /
`size.longest_edge` (pixels of all sampled frames together; `total_pixels` unused), and a timestamp before each
temporal patch (`VideoPlan.timestamps_s`).

`style="llava_onevision2"` is the rule of LLaVA-OneVision-2's processor (`mmpack.packing.video_tokens_ov2`):
8, 16 or `max_frames` frames by duration, `min_pixels` / `max_pixels` its video processor's resize bounds, then
`image_min_pixels` / `image_max_pixels` (the image rule's) for the image processor every frame goes through, a
timestamp before each frame, and `<|image_pad|>` tokens (each frame is an image to the model).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mmpack.packing import video_tokens_ov2 as ov2
from mmpack.packing import video_tokens_qwen3 as qwen3
from mmpack.packing.errors import MmpackError
from mmpack.packing.image_tokens import smart_resize

VIDEO_RULE_STYLES = ("qwen-vl-utils", "qwen3_vl", ov2.STYLE)


class VideoRuleError(MmpackError, ValueError):
    """A video the rule refuses; `reason` is "video_too_short", "video_aspect_ratio" or "video_too_small"."""

    def __init__(self, reason: str, message: str):
        super().__init__(message, reason=reason)


@dataclass(kw_only=True, frozen=True)
class VideoMeta:
    """What the container says about a video stream (no frame decoded).

    `frame_count_exact` is False where the container has no frame count and `total_frames` is
    round(duration_s * fps): then frame k means the frame shown at time k / fps from the stream start.
    """

    total_frames: int
    fps: float
    width: int
    height: int
    duration_s: float
    frame_count_exact: bool = True

    def __post_init__(self) -> None:
        if self.total_frames < 0 or not self.fps > 0 or self.width < 1 or self.height < 1:
            raise ValueError(
                f"invalid video metadata: {self.total_frames} frames at {self.fps} fps, "
                f"{self.width}x{self.height} (w x h)"
            )


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
        )


@dataclass(kw_only=True, frozen=True)
class VideoTokenRule:
    """Frame sampling and sizing of videos (qwen-vl-utils 0.0.14; see the module docstring)."""

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
    style: str = "qwen-vl-utils"  # whose rule: VIDEO_RULE_STYLES
    image_min_pixels: int = 0  # llava_onevision2 only: the image rule's bounds, which every frame then takes
    image_max_pixels: int = 0

    def __post_init__(self) -> None:
        if self.style not in VIDEO_RULE_STYLES:
            raise ValueError(f"video rule style must be one of {VIDEO_RULE_STYLES}, got {self.style!r}")
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
        if self.style == ov2.STYLE and (
            self.temporal_patch_size != 1 or min(self.image_min_pixels, self.image_max_pixels) < 1
        ):
            raise ValueError(
                f"the {ov2.STYLE} video rule needs temporal_patch_size 1 and the image rule's pixel bounds, got "
                f"{self.temporal_patch_size}, {self.image_min_pixels}, {self.image_max_pixels}"
            )

    @property
    def factor(self) -> int:
        """Side granularity in pixels: one merged token covers factor x factor pixels of a frame pair."""
        return self.patch_size * self.merge_size

    def num_frames(self, total_frames: int, video_fps: float) -> int:
        """Frames sampled from a video of `total_frames` at `video_fps` (qwen-vl-utils `smart_nframes`)."""
        if self.style == ov2.STYLE:
            return ov2.num_frames(total_frames, video_fps, max_frames=self.max_frames)
        if self.style == "qwen3_vl":
            n = qwen3.num_frames(
                total_frames, video_fps, fps=self.fps, min_frames=self.min_frames, max_frames=self.max_frames
            )
            if n < self.temporal_patch_size:
                raise VideoRuleError(
                    "video_too_short", f"a video of {total_frames} frames gives {n} sampled frames; at "
                    f"least {self.temporal_patch_size} are needed",
                )  # fmt: skip
            return n
        ff = self.frame_factor
        min_frames = math.ceil(self.min_frames / ff) * ff
        max_frames = math.floor(min(self.max_frames, total_frames) / ff) * ff
        wanted = total_frames / video_fps * self.fps
        nframes = min(max(wanted, min_frames), max_frames, total_frames)
        nframes = math.floor(nframes / ff) * ff
        if not ff <= nframes <= total_frames:
            raise VideoRuleError(
                "video_too_short",
                f"a video of {total_frames} frames gives {nframes} sampled frames; at least {ff} are needed",
            )
        return int(nframes)

    def frame_max_pixels(self, nframes: int) -> float:
        """Per-frame pixel cap for `nframes` sampled frames (the total-pixel budget shared by the frames)."""
        shared = self.total_pixels / nframes * self.frame_factor
        return max(min(self.max_pixels, shared), int(self.min_pixels * 1.05))

    def resized_hw(self, height: int, width: int, nframes: int) -> tuple[int, int]:
        """(h', w') every sampled frame is resized to (qwen-vl-utils `smart_resize` for videos)."""
        factor = self.factor
        if self.style == ov2.STYLE:
            return self._ov2_resized_hw(height, width)
        if self.style == "qwen3_vl":
            try:
                return qwen3.resized_hw(
                    nframes, height, width, factor=factor, temporal_factor=self.temporal_patch_size,
                    min_pixels=self.min_pixels, max_pixels=self.max_pixels,
                )  # fmt: skip
            except ValueError as exc:
                raise VideoRuleError(
                    "video_aspect_ratio", f"video of {width}x{height} (w x h): {exc}"
                ) from None
        aspect = max(height, width) / min(height, width)
        if aspect > self.max_aspect_ratio:
            raise VideoRuleError(
                "video_aspect_ratio",
                f"video of {width}x{height} (w x h) has aspect ratio {aspect:.1f}, "
                f"above the limit of {self.max_aspect_ratio}",
            )
        max_pixels = self.frame_max_pixels(nframes)
        h_bar, w_bar = smart_resize(
            height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=max_pixels, video=True
        )
        if h_bar < factor or w_bar < factor:  # qwen-vl-utils would resize to an empty frame here
            raise VideoRuleError(
                "video_too_small",
                f"video of {width}x{height} (w x h) is too elongated for {max_pixels:.0f} pixels per frame: "
                f"a side would shrink below {factor} pixels",
            )
        return h_bar, w_bar

    def _ov2_resized_hw(self, height: int, width: int) -> tuple[int, int]:
        try:
            return ov2.resized_hw(
                height, width, patch_size=self.patch_size, merge_size=self.merge_size,
                min_pixels=self.min_pixels, max_pixels=self.max_pixels, image_min_pixels=self.image_min_pixels,
                image_max_pixels=self.image_max_pixels,
            )  # fmt: skip
        except ValueError as exc:
            raise VideoRuleError("video_too_small", f"video of {width}x{height} (w x h): {exc}") from None

    def plan(self, meta: VideoMeta) -> VideoPlan:
        """Frames, size, grid and tokens of a video from its container metadata."""
        nframes = self.num_frames(meta.total_frames, meta.fps)
        h_bar, w_bar = self.resized_hw(meta.height, meta.width, nframes)
        tp = self.temporal_patch_size
        grid = (-(-nframes // tp), h_bar // self.patch_size, w_bar // self.patch_size)
        sample_fps = nframes / max(meta.total_frames, 1e-6) * meta.fps
        qwen3_vl = self.style == "qwen3_vl"
        sample = qwen3.frame_indices if qwen3_vl else sample_frame_indices
        indices = [int(i) for i in sample(meta.total_frames, nframes)]
        return VideoPlan(
            frame_indices=tuple(indices),
            resized_hw=(h_bar, w_bar),
            grid_thw=grid,
            num_tokens=self.tokens_of_grid(grid),
            sample_fps=sample_fps,
            second_per_grid_t=tp / sample_fps,
            frame_count_exact=meta.frame_count_exact,
            video_fps=meta.fps,
            timestamps_s=self._timestamps(indices, meta.fps),
        )

    def _timestamps(self, indices: list[int], video_fps: float) -> tuple[float, ...]:
        """Seconds written before each temporal patch, where the rule writes them."""
        if self.style == ov2.STYLE:
            return tuple(ov2.frame_seconds(i, video_fps) for i in indices)
        if self.style == "qwen3_vl":
            return qwen3.timestamps(indices, video_fps, self.temporal_patch_size)
        return ()

    def tokens_of_grid(self, grid_thw: tuple[int, int, int]) -> int:
        """LLM tokens (<|video_pad|> count) of a vision grid (t, h, w) in patches."""
        t, gh, gw = grid_thw
        return int(t * gh * gw) // (self.merge_size**2)

    def to_dict(self) -> dict[str, Any]:
        """The manifest's "video_rule" entry; `style` only where it is not qwen-vl-utils (the rule of the
        manifests written before there was a choice)."""
        d = asdict(self)
        if self.style != ov2.STYLE:  # only that rule has image bounds
            del d["image_min_pixels"], d["image_max_pixels"]
        if self.style == VIDEO_RULE_STYLES[0]:
            del d["style"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VideoTokenRule:
        """The rule of a manifest's "video_rule" entry (unknown keys are an error, missing ones default)."""
        return cls(**d)


def sample_frame_indices(total_frames: int, nframes: int) -> np.ndarray:
    """round(torch.linspace(0, total_frames - 1, nframes)) as int64, bit for bit without torch.

    torch computes linspace in float32 with one rounding per value (a fused multiply-add):
    start + step * i for the first half, end - step * (n - 1 - i) for the second, step = (end - start) / (n - 1)
    in float32. A float64 linspace rounds differently for about one video length in eight.
    """
    if nframes < 1 or total_frames < 1:
        raise ValueError(f"need nframes >= 1 and total_frames >= 1, got {nframes}, {total_frames}")
    if nframes == 1:
        return np.zeros(1, np.int64)
    end = np.float32(total_frames - 1)
    step = float(end / np.float32(nframes - 1))
    i = np.arange(nframes, dtype=np.float64)
    values = np.where(i < nframes // 2, step * i, float(end) - step * (nframes - 1 - i)).astype(np.float32)
    return np.round(values).astype(np.int64)  # numpy rounds half to even, as torch.round does


def video_temporal_positions(grid_t: int, second_per_grid_t: float, tokens_per_second: float) -> np.ndarray:
    """MRoPE temporal offsets of a video's temporal patches: int64 [grid_t], before adding the start position.

    As Qwen2.5-VL's `get_rope_index` in transformers computes them from the float32 `second_per_grid_ts`
    its processor returns: interval = float32(tokens_per_second * second_per_grid_t), offsets =
    trunc(float32(i * interval)). (Qwen2-VL, without `second_per_grid_ts`, is the interval 1 case.)
    """
    interval = np.float32(tokens_per_second) * np.float32(second_per_grid_t)
    return (np.arange(grid_t, dtype=np.float32) * interval).astype(np.int64)
