"""The Qwen3-VL video rule (transformers 5's `Qwen3VLVideoProcessor` and `Qwen3VLProcessor`): frames sampled,
frame size, and the timestamps written before each temporal patch; `VideoTokenRule(style="qwen3_vl")` applies it
(`VIDEO_STYLE`), and a model folder whose `video_preprocessor_config.json` names `Qwen3VLVideoProcessor` selects it.

    nframes = int(total / video_fps * fps), clamped to [min_frames, max_frames], then to at most total
    indices = round(numpy linspace(0, total - 1, nframes))          (float64, round half to even)
    h', w'  = smart_resize(nframes, h, w, factor = patch * merge, temporal_factor = temporal_patch,
                           min_pixels = size.shortest_edge, max_pixels = size.longest_edge)
              (the pixel bounds hold for all sampled frames together: t' * h' * w', t' = nframes rounded
              to a multiple of the temporal patch)
    grid    = (ceil(nframes / temporal_patch), h' / patch, w' / patch)   (an odd last frame is repeated)

The processor writes each temporal patch as ``<{t:.1f} seconds><|vision_start|>`` + h' w' / (patch merge)^2
``<|video_pad|>`` + ``<|vision_end|>``, t the mean of the timestamps (index / video_fps) of its first and last
frame, in place of the chat template's one ``<|video_pad|>``. `min_pixels` / `max_pixels` are its
`size.shortest_edge` / `size.longest_edge` (pixels of all sampled frames together; `total_pixels` unused).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mmpack.packing.image_tokens import read_processor_config, smart_resize
from mmpack.packing.video_style import FolderClaim, VideoRuleError, VideoStyle

if TYPE_CHECKING:
    from mmpack.packing.image_tokens import ImageTokenRule

VIDEO_PREPROCESSOR_CONFIG = "video_preprocessor_config.json"
PROCESSOR_TYPE = "Qwen3VLVideoProcessor"
# `Qwen3VLVideoProcessor`'s class defaults: what transformers uses for keys a config file does not set
PROCESSOR_DEFAULTS: dict[str, Any] = {
    "fps": 2.0,
    "min_frames": 4,
    "max_frames": 768,
    "min_pixels": 128 * 32 * 32,
    "max_pixels": 32 * 32 * 768,
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
}


def rule_fields(config: dict[str, Any], *, source: str) -> dict[str, Any]:
    """`VideoTokenRule` fields (style, fps, frame bounds, pixel bounds, patch sizes) of a `Qwen3VLVideoProcessor`'s
    `video_preprocessor_config.json`, read as transformers reads it; ValueError naming `source` for settings
    this rule does not reproduce."""
    kind = config.get("video_processor_type", PROCESSOR_TYPE)
    if kind != PROCESSOR_TYPE:
        raise ValueError(f"{source}: video_processor_type {kind!r} is not {PROCESSOR_TYPE}")
    refused = {"do_sample_frames": False, "do_resize": False, "cap_pixels_per_frame": True}
    for key, value in refused.items():
        if config.get(key) is value:
            raise ValueError(
                f"{source}: {key}={value} is not supported (mmpack samples and resizes as the default)"
            )
    if config.get("num_frames") is not None:
        raise ValueError(
            f"{source}: num_frames (a fixed frame count) is not supported; mmpack samples by fps"
        )
    size = config.get("size") or {}
    out = dict(PROCESSOR_DEFAULTS)
    out |= {
        k: config[k] for k in ("fps", "min_frames", "max_frames", "patch_size", "merge_size") if k in config
    }
    out |= {k: config[k] for k in ("temporal_patch_size",) if k in config}
    if "shortest_edge" in size:
        out["min_pixels"] = size["shortest_edge"]
    if "longest_edge" in size:
        out["max_pixels"] = size["longest_edge"]
    try:
        return {"style": "qwen3_vl", **{k: (float(v) if k == "fps" else int(v)) for k, v in out.items()}}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from None


def num_frames(total_frames: int, video_fps: float, *, fps: float, min_frames: int, max_frames: int) -> int:
    """Frames sampled from a video of `total_frames` at `video_fps` (`Qwen3VLVideoProcessor.sample_frames`)."""
    wanted = int(total_frames / video_fps * fps)
    return min(max(wanted, min_frames), max_frames, total_frames)


def frame_indices(total_frames: int, nframes: int) -> np.ndarray:
    """int64 [nframes]: numpy's float64 linspace over the frames, rounded half to even."""
    return np.linspace(0, total_frames - 1, nframes).round().astype(np.int64)


def resized_hw(
    nframes: int, height: int, width: int, *, factor: int, temporal_factor: int, min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:  # fmt: skip
    """(h', w') of the sampled frames: the video processor's checks, then its `smart_resize`
    (`mmpack.packing.image_tokens.smart_resize` over all the frames); ValueError as it raises."""
    if nframes < temporal_factor:
        raise ValueError(f"{nframes} sampled frames, fewer than the temporal patch of {temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} is above 200")
    return smart_resize(
        height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels, frames=nframes,
        temporal_factor=temporal_factor,
    )  # fmt: skip


def timestamps(indices: list[int], video_fps: float, temporal_patch_size: int) -> tuple[float, ...]:
    """Seconds of each temporal patch (`Qwen3VLProcessor._calculate_timestamps`): indices padded with the
    last one to whole patches, each patch the mean of its first and last frame's time."""
    padded = list(indices)
    if len(padded) % temporal_patch_size:
        padded += [padded[-1]] * (temporal_patch_size - len(padded) % temporal_patch_size)
    times = [i / video_fps for i in padded]
    m = temporal_patch_size
    return tuple((times[i] + times[i + m - 1]) / 2 for i in range(0, len(times), m))


def timestamp_text(seconds: float) -> str:
    """The text before a temporal patch's tokens."""
    return f"<{seconds:.1f} seconds>"


def placeholder_ids(tokenizer: Any, plan: Any) -> np.ndarray | None:
    """The ids a video's one `<|video_pad|>` becomes where its plan has timestamps (see the module docstring);
    None where the pad is only repeated (`tokenizer`: a `mmpack.packing.tokenizer.TextTokenizer`, `plan`: a
    `mmpack.packing.video_tokens.VideoPlan`).

    The timestamp text sits between special tokens, which the tokenizer splits out before its pre-tokenizer:
    encoding it alone gives the ids it has in the whole text."""
    if not plan.timestamps_s:
        return None
    ids = tokenizer.special_ids
    per_patch = plan.num_tokens // plan.grid_thw[0]
    frame = [ids["vision_start"], *[ids["video_pad"]] * per_patch, ids["vision_end"]]
    out = [tokenizer.encode(timestamp_text(t)) + frame for t in plan.timestamps_s]
    return np.asarray([i for part in out for i in part], dtype=np.uint32)


# the VideoTokenRule fields the processor's defaults give when --video-rule qwen3_vl chooses it (patch sizes: the
# image rule's)
_DEFAULT_FIELDS = ("fps", "min_frames", "max_frames", "min_pixels", "max_pixels")


class Qwen3VLStyle(VideoStyle):
    """transformers' Qwen3-VL video processor (see the module docstring)."""

    name = "qwen3_vl"

    def num_frames(self, rule: Any, total_frames: int, video_fps: float) -> int:
        n = num_frames(
            total_frames, video_fps, fps=rule.fps, min_frames=rule.min_frames, max_frames=rule.max_frames
        )
        if n < rule.temporal_patch_size:
            raise VideoRuleError(
                "video_too_short",
                f"a video of {total_frames} frames gives {n} sampled frames; at least {rule.temporal_patch_size} "
                "are needed",
            )
        return n

    def frame_indices(self, rule: Any, total_frames: int, nframes: int) -> Sequence[int]:
        return frame_indices(total_frames, nframes).tolist()

    def resized_hw(self, rule: Any, height: int, width: int, nframes: int) -> tuple[int, int]:
        try:
            return resized_hw(
                nframes, height, width, factor=rule.factor, temporal_factor=rule.temporal_patch_size,
                min_pixels=rule.min_pixels, max_pixels=rule.max_pixels,
            )  # fmt: skip
        except ValueError as exc:
            raise VideoRuleError("video_aspect_ratio", f"video of {width}x{height} (w x h): {exc}") from None

    def timestamps(self, rule: Any, indices: Sequence[int], video_fps: float) -> tuple[float, ...]:
        return timestamps(list(indices), video_fps, rule.temporal_patch_size)

    def token_ids(self, tokenizer: Any, plan: Any) -> np.ndarray | None:
        return placeholder_ids(tokenizer, plan)

    def rule_fields(self, given: Mapping[str, Any], image_rule: ImageTokenRule) -> dict[str, Any]:
        return {**{f: PROCESSOR_DEFAULTS[f] for f in _DEFAULT_FIELDS}, **given}

    def claim(self, folder: str) -> FolderClaim | None:
        found = read_processor_config(folder, VIDEO_PREPROCESSOR_CONFIG)
        if found is None or found[1].get("video_processor_type") != PROCESSOR_TYPE:
            return None  # other processors' videos follow qwen-vl-utils (the flags)
        path, config = found
        fields = {k: v for k, v in rule_fields(config, source=path).items() if k != "style"}
        return FolderClaim(path, fields, fixed=True)


VIDEO_STYLE = Qwen3VLStyle()
