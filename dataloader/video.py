"""Video bytes -> the planned frames -> `pixel_values_videos` rows, in the loader's workers.

`decode_planned_frames` decodes exactly the frames of a `VideoPlan` (recorded by the offline scan): it lists
the stream's packet timestamps (demux only), maps each planned frame index to a presentation timestamp,
and for each one seeks to the keyframe at or before it and decodes forward, never through the whole video
unless the frames lie in one group of pictures. Each frame is resized to the plan's (h', w') as soon as it
is decoded (bicubic, antialiased, as qwen-vl-utils resizes with torchvision: float, clamp to [0, 255],
round), so memory holds one decoded frame plus the resized ones.

`video_to_patches` then rescales, normalises and patchifies frame pairs in the layout of transformers'
`Qwen2VLVideoProcessor.patchify`: rows (t, h-window, w-window, dy, dx), columns (channel, temporal, y, x),
i.e. [t * gh * gw, 3 * temporal_patch_size * patch * patch]. Patch sizes, mean, std and rescale factor are
the image rule's (`ImageTokenRule`): the model's one processor config, and the values the image path uses.
"""

from __future__ import annotations

import bisect
import io
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmpack.packing.errors import MmpackError
from mmpack.packing.image_tokens import ImageTokenRule
from mmpack.packing.video_tokens import VideoPlan


class VideoDecodeError(MmpackError, ValueError):
    """The recorded frames of a video cannot be decoded (changed or damaged file); names the video."""

    default_reason = "video_decode"


@dataclass(frozen=True)
class VideoPixels:
    """Model inputs of one video: pixel rows, its grid (t, h, w) in patches and seconds per temporal step."""

    pixel_values_videos: np.ndarray
    video_grid_thw: tuple[int, int, int]
    second_per_grid_t: float
    # a codec video's (`mmpack.dataloader.codec_video`): each patch's source (frame, row, column), int64 [P, 3]
    patch_positions: np.ndarray | None = None


def load_video(
    src: str | os.PathLike[str] | bytes | bytearray | memoryview,
    plan: VideoPlan,
    rule: ImageTokenRule | None = None,
    *,
    name: str | None = None,
) -> VideoPixels:
    """Decode, resize, normalise and patchify the planned frames of one video (`rule`: patch sizes, mean, std)."""
    rule = rule or ImageTokenRule()
    label = name or "<bytes>"
    frames = decode_planned_frames(src, plan, name=name)
    patches = video_to_patches(frames, rule)
    p, tp = rule.patch_size, rule.temporal_patch_size
    grid = (-(-frames.shape[0] // tp), frames.shape[1] // p, frames.shape[2] // p)
    if grid != tuple(plan.grid_thw):
        raise VideoDecodeError(f"video {label}: decoded grid {grid} differs from the plan's {plan.grid_thw}")
    return VideoPixels(patches, grid, plan.second_per_grid_t)


def decode_planned_frames(
    src: str | os.PathLike[str] | bytes | bytearray | memoryview,
    plan: VideoPlan,
    *,
    name: str | None = None,
    counters: dict[str, int] | None = None,
    keep_frames: bool = True,
) -> np.ndarray:
    """The planned frames resized to the plan's (h', w'): uint8 [n, h', w', 3] (RGB), in plan order.

    `counters`, when given, receives "frames_decoded" and "seeks" (for tests and benchmarks). With
    `keep_frames=False` every planned frame is decoded (same errors) but none kept: an empty array comes back.
    """
    import av

    label = name or (os.fspath(src) if isinstance(src, (str, os.PathLike)) else "<bytes>")
    source: Any = (
        io.BytesIO(bytes(src)) if isinstance(src, (bytes, bytearray, memoryview)) else os.fspath(src)
    )
    try:
        with av.open(source) as container:
            if not container.streams.video:
                raise VideoDecodeError(f"video {label} has no video stream")
            stream = container.streams.video[0]
            # one decoder thread: loader workers are the parallelism, and FFmpeg's automatic thread count
            # would hold frame buffers per thread (memory) and contend with the other workers (time)
            stream.codec_context.thread_count = 1
            frame_pts, keyframe_pts = _packet_timestamps(container, stream, label)
            targets = frame_timestamps(frame_pts, plan, float(stream.time_base), label)
            counts = counters if counters is not None else {}
            size_hw = plan.resized_hw if keep_frames else None
            decoded = _decode_at(container, stream, targets, frame_pts, keyframe_pts, size_hw, label, counts)
    except av.error.FFmpegError as exc:
        raise VideoDecodeError(f"video {label}: cannot decode the recorded frames: {exc}") from None
    if not keep_frames:
        return np.zeros((0, 0, 0, 3), np.uint8)
    return np.stack([decoded[pts] for pts in targets])


def _packet_timestamps(container: Any, stream: Any, label: str) -> tuple[list[int], list[int]]:
    """Sorted presentation timestamps of the frames the decoder shows, and of all keyframes, from the packets
    (not decoded). Frames an edit list flags to be discarded (before a stream-copy cut) are not shown, so they
    are not frames of the plan either (the scan counted the same way); their keyframes still serve seeks."""
    frame_pts, keyframe_pts = [], []
    for packet in container.demux(stream):
        if packet.size and packet.pts is not None:
            if not packet.is_discard:
                frame_pts.append(packet.pts)
            if packet.is_keyframe:
                keyframe_pts.append(packet.pts)
    if not frame_pts:
        raise VideoDecodeError(f"video {label} has no frames")
    return sorted(frame_pts), sorted(keyframe_pts)


def frame_timestamps(frame_pts: list[int], plan: VideoPlan, time_base: float, label: str) -> list[int]:
    """Presentation timestamp of each planned frame, given the sorted timestamps of all frames.

    In the plan's order (its video style's, not necessarily increasing). Exact frame counts: frame k is the k-th
    frame in presentation order. Estimated counts
    (`frame_count_exact` False): frame k is the frame shown at k / video_fps after the first frame.
    """
    if plan.frame_count_exact:
        last = max(plan.frame_indices)  # in the style's order, which need not be increasing
        if last >= len(frame_pts):
            raise VideoDecodeError(
                f"video {label} has {len(frame_pts)} frames, the plan asks for frame {last}: "
                "the file changed since the dataset was packed"
            )
        return [frame_pts[i] for i in plan.frame_indices]
    times = [frame_pts[0] + round(i / plan.video_fps / time_base) for i in plan.frame_indices]
    return [frame_pts[max(0, bisect.bisect_right(frame_pts, t) - 1)] for t in times]


def _decode_at(
    container: Any,
    stream: Any,
    targets: list[int],
    frame_pts: list[int],
    keyframe_pts: list[int],
    size_hw: tuple[int, int] | None,
    label: str,
    counters: dict[str, int],
) -> dict[int, np.ndarray]:
    """Resized RGB frames at the wanted timestamps.

    For each wanted frame: seek to the keyframe at or before it (FFmpeg's backward seek) and decode forward
    from there, unless that keyframe is not past the frame that follows the last one decoded: then decoding
    on skips nothing a seek would.
    """
    found: dict[int, np.ndarray] = {}
    counters["frames_decoded"] = counters["seeks"] = 0
    frames: Any = None
    last_pts: int | None = None
    for target in sorted(set(targets)):
        k = bisect.bisect_right(keyframe_pts, target) - 1
        keyframe = keyframe_pts[k] if k >= 0 else None
        if (
            frames is None
            or last_pts is None
            or (keyframe is not None and keyframe > _next(frame_pts, last_pts))
        ):
            container.seek(target, stream=stream, backward=True)
            frames = container.decode(stream)
            counters["seeks"] += 1
        for frame in frames:
            counters["frames_decoded"] += 1
            if frame.pts is None or frame.pts < target:
                continue
            last_pts = frame.pts
            if frame.pts > target:
                raise VideoDecodeError(
                    f"video {label}: no frame at timestamp {target} after seeking (next is {frame.pts})"
                )
            found[target] = resize_frame(frame.to_ndarray(format="rgb24"), size_hw) if size_hw else _NOTHING
            break
        else:
            raise VideoDecodeError(f"video {label} ended before the frame at timestamp {target}")
    return found


_NOTHING = np.zeros((0, 0, 3), np.uint8)  # a frame decoded for a check only (`keep_frames=False`)


def _next(frame_pts: list[int], pts: int) -> int:
    """The timestamp of the frame after `pts` in presentation order (`pts` itself for the last frame)."""
    i = bisect.bisect_right(frame_pts, pts)
    return frame_pts[i] if i < len(frame_pts) else pts


def resize_frame(rgb: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    """uint8 [h', w', 3] from uint8 [H, W, 3]: bicubic, antialiased, clamped and rounded (torchvision's way)."""
    import torch
    import torch.nn.functional as F

    h, w = size_hw
    if rgb.shape[:2] == (h, w):
        return np.ascontiguousarray(rgb)
    x = torch.from_numpy(rgb).permute(2, 0, 1).contiguous()[None].to(torch.float32)  # planar: faster
    y = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
    return y.clamp_(0, 255).round_().to(torch.uint8)[0].permute(1, 2, 0).contiguous().numpy()


def video_to_patches(frames: np.ndarray, rule: ImageTokenRule | None = None) -> np.ndarray:
    """float32 [t * gh * gw, 3 * tp * p * p] from uint8 frames [n, H, W, 3] (see the module docstring).

    A frame count that is not a multiple of the temporal patch is padded with copies of the last frame,
    as transformers does. Values are bit-identical to the image path's for the same 8-bit levels.
    """
    rule = rule or ImageTokenRule()
    n, height, width, channels = frames.shape
    p, m, tp = rule.patch_size, rule.merge_size, rule.temporal_patch_size
    if channels != 3 or height % (p * m) or width % (p * m) or n == 0 or frames.dtype != np.uint8:
        raise ValueError(
            f"frames {frames.dtype} {frames.shape} are not uint8 n x (multiple of {p * m})^2 x 3"
        )
    if n % tp:
        frames = np.concatenate([frames, np.repeat(frames[-1:], tp - n % tp, axis=0)])
        n = frames.shape[0]
    gt, gh, gw = n // tp, height // p, width // p
    # [gt, tp, wy, dy, py, wx, dx, px, C] -> [gt, wy, wx, dy, dx, C, tp, py, px], still uint8 (cheap to move)
    blocks = frames.reshape(gt, tp, gh // m, m, p, gw // m, m, p, 3).transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    blocks = blocks.reshape(gt * gh * gw, 3, tp, p, p)
    out = np.empty(blocks.shape, dtype=np.float32)
    out[:] = rule.normalise_table[np.arange(3).reshape(1, 3, 1, 1, 1), blocks]
    return out.reshape(gt * gh * gw, rule.patch_dim)


def collate_videos(videos: list[VideoPixels]) -> dict[str, np.ndarray]:
    """The video inputs of a micro-batch, in sample order: rows concatenated, one grid and interval per video."""
    if not videos:
        return {
            "pixel_values_videos": np.zeros((0, 0), np.float32),
            "video_grid_thw": np.zeros((0, 3), np.int64),
            "second_per_grid_ts": np.zeros(0, np.float32),
        }
    return {
        "pixel_values_videos": np.concatenate([v.pixel_values_videos for v in videos]),
        "video_grid_thw": np.asarray([v.video_grid_thw for v in videos], dtype=np.int64),
        "second_per_grid_ts": np.asarray([v.second_per_grid_t for v in videos], dtype=np.float32),
    }
