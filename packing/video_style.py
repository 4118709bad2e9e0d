"""What one video rule decides, as a strategy object (`VideoStyle`), and the metadata it decides from.

A video rule (`mmpack.packing.video_tokens.VideoTokenRule`) is a frozen set of numbers (fps, frame and pixel
bounds, patch sizes) plus a `style`: the name of a `VideoStyle` in the registry (`mmpack.packing.video_rules`).
The style is whose rule it is (qwen-vl-utils, a model's processor) and says everything that differs between
processors:

- planning: how many frames a video gives (`num_frames`), which ones (`frame_indices`), their size
  (`resized_hw`) and the seconds written before its tokens (`timestamps`), all from container metadata
  (`VideoMeta`); the grid and token count follow from the size and the patch sizes;
- the manifest form: whether the rule records the image rule's pixel bounds (`image_bounds`);
- the text: what a video's `<|video_pad|>` (or whole vision block, `whole_block`) becomes (`token_ids`), and
  the control tokens that needs beyond the image style's (`control_tokens`);
- the loader: whether the tower takes the frames as video frames or as images (`frames_as_images`);
- the model folder: which folder selects it (`claim`), its fields there (`rule_fields`) and which `--video-*`
  options it takes (`options`).

Everything here is pure (no torch, no decoding); a new processor is one module with one `VideoStyle` and one
line in the registry.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mmpack.packing.errors import MmpackError

if TYPE_CHECKING:
    from mmpack.packing.image_tokens import ImageTokenRule
    from mmpack.packing.tokenizer import ControlTokens


class VideoRuleError(MmpackError, ValueError):
    """A video the rule refuses; `reason` is "video_too_short", "video_aspect_ratio", "video_too_small" or
    "codec_video"."""

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


@dataclass(frozen=True)
class FolderClaim:
    """A model folder that selects a style: the file or setting that does (`source`, for messages) and the
    rule fields it fixes. `fixed`: the folder fixes every option (a `--video-*` flag must agree with it);
    otherwise the style's `options` may still be set."""

    source: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    fixed: bool = False


class VideoStyle(abc.ABC):
    """One video rule's behaviour (see the module docstring). Methods take the `VideoTokenRule` (`rule`) whose
    numbers they apply; subclasses set `name` and implement the planning methods."""

    name: str  # `VideoTokenRule.style`, as the manifest and `--video-rule` name it
    frames_as_images: bool = False  # the loader hands the frames to the tower as images (image pad blocks)
    image_bounds: bool = False  # the rule holds and records the image rule's pixel bounds (image_*_pixels)
    whole_block: bool = False  # `token_ids` replace the whole `<|vision_start|><|video_pad|><|vision_end|>`
    with_images: bool = True  # a sample may hold images beside its videos
    options: tuple[str, ...] | None = None  # `VideoTokenRule` fields a --video-* flag may set (None: all)
    options_note: str = ""  # why the other flags are refused (after "{where} ")
    control_tokens: ControlTokens | None = None  # tokens its text needs beyond the image style's (None: none)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def check(self, rule: Any) -> None:
        """ValueError where `rule`'s numbers do not suit this style (beyond `VideoTokenRule`'s own checks)."""
        return None

    @abc.abstractmethod
    def num_frames(self, rule: Any, total_frames: int, video_fps: float) -> int:
        """Frames sampled from a video of `total_frames` at `video_fps` (VideoRuleError where too few)."""

    @abc.abstractmethod
    def frame_indices(self, rule: Any, total_frames: int, nframes: int) -> Sequence[int]:
        """Which `nframes` frames, in the order the tower takes them."""

    @abc.abstractmethod
    def resized_hw(self, rule: Any, height: int, width: int, nframes: int) -> tuple[int, int]:
        """(h', w') every sampled frame is resized to, multiples of `rule.factor` (VideoRuleError if none)."""

    def timestamps(self, rule: Any, indices: Sequence[int], video_fps: float) -> tuple[float, ...]:
        """Seconds written before each temporal patch (or frame); () where the style writes none."""
        return ()

    def token_ids(self, tokenizer: Any, plan: Any) -> np.ndarray | None:
        """The ids a video's one `<|video_pad|>` (with `whole_block`, its whole vision block) becomes; None
        where its pad is only repeated `plan.num_tokens` times (`tokenizer`: a `TextTokenizer`, `plan`: a
        `VideoPlan`)."""
        return None

    def leading_text(self, plan: Any) -> str:
        """With `whole_block`: the text `token_ids` starts with, which the packer checks does not merge with
        the text before the video ("" where it starts with a special token)."""
        return ""

    def trailing_text(self, plan: Any) -> str:
        """With `whole_block`: the text the processor's rewrite takes with the block, which `token_ids` leaves
        to the text after it (LLaVA-OneVision-2's codec runs: the newline); the packer checks it is there."""
        return ""

    def codec_plan_fields(self, rule: Any, codec: Mapping[str, Any]) -> dict[str, Any]:
        """`VideoPlan` fields of a codec-stream video (canvases, `mmpack.packing.video_codec_ov2`) from the scan's
        summary; VideoRuleError where the style reads video files only."""
        raise VideoRuleError(
            "codec_video",
            f"codec canvases (a cv-preinfer folder) are read by the llava_onevision2 video rule only, not {self.name} "
            "(--video-rule llava_onevision2, or --model with a LLaVA-OneVision-2 folder)",
        )

    def rule_fields(self, given: Mapping[str, Any], image_rule: ImageTokenRule) -> dict[str, Any]:
        """`VideoTokenRule` fields (no patch sizes, no style) of this style under the options `given`
        (field -> value, from flags or a model folder): its own defaults first."""
        return dict(given)

    def claim(self, folder: str) -> FolderClaim | None:
        """The claim of a model folder whose processor follows this style; None where it does not."""
        return None


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
