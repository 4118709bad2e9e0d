"""Image-token rule (Qwen2-VL `smart_resize`), image size from headers, and image -> patch pixels.

The offline packer counts the tokens of an image with `ImageTokenRule.num_tokens(h, w)` on the size that
`read_image_size` reads from the header; the loader turns the same bytes into pixel patches with
`image_to_patches`, exactly as transformers' `Qwen2VLImageProcessorPil` does for a PIL image opened from
those bytes. Neither side applies the EXIF orientation (that processor does not either): the pixels are
used as stored, so the count offline equals what the loader produces, exactly.

Resize rule (Qwen2-VL, factor = patch_size * merge_size)::

    reject if max(h, w) / min(h, w) > max_aspect_ratio
    h', w' = round(h / factor) * factor, round(w / factor) * factor     (Python round: half to even)
    if h' * w' > max_pixels:  beta = sqrt(h * w / max_pixels)
                              h', w' = floor(h / beta / factor) * factor, ... (at least factor)
    elif h' * w' < min_pixels: beta = sqrt(min_pixels / (h * w))
                              h', w' = ceil(h * beta / factor) * factor, ...

Images smaller than factor are upscaled by the min_pixels branch, as transformers 5 does.
Tokens = (h' / factor) * (w' / factor); the vision grid is (1, h' / patch, w' / patch) patches.
"""

from __future__ import annotations

import io
import math
import os
import struct
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import IO, Any

import numpy as np

from mmpack.packing.errors import MmpackError
from mmpack.packing.image_rules import DEFAULT_IMAGE_STYLE, ImageStyle, image_style, style_of_processor

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_FORMAT_NAMES = {"JPEG": "jpg", "MPO": "jpg", "TIFF": "tiff"}
_PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"


class ImageHeaderError(MmpackError, ValueError):
    """An image whose header cannot be read, or whose file is truncated."""

    default_reason = "unreadable_image"


class ImageSizeError(MmpackError, ValueError):
    """An image size refused; `reason` is "image_aspect_ratio", "image_size_invalid" (no pixels) or
    "image_too_large" (over a pixel limit)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message, reason=reason)


def smart_resize(
    height: int,
    width: int,
    *,
    factor: int,
    min_pixels: float,
    max_pixels: float,
    video: bool = False,
    frames: int = 1,
    temporal_factor: int = 1,
) -> tuple[int, int]:
    """Qwen-VL's resize rule, (h', w'): sides multiples of `factor`, area in [min_pixels, max_pixels], aspect
    ratio about kept. The upstream versions differ at the edges: images (transformers'
    `Qwen2VLImageProcessor`) round the sides first and keep them at least `factor` when shrinking; videos
    (`video=True`, qwen-vl-utils) take each side at least `factor` first and keep nothing when shrinking (a
    side may come out below `factor`, which the video rule refuses). Qwen3-VL's video processor is the image
    variant over all `frames` sampled frames together: the bounds hold for t' x h' x w' (t' = `frames`
    rounded to a multiple of `temporal_factor`) and the scale comes from `frames` x h x w."""
    least = factor if video else 0
    h_bar = max(least, round(height / factor) * factor)
    w_bar = max(least, round(width / factor) * factor)
    t_bar = round(frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        least = 0 if video else factor
        h_bar = max(least, math.floor(height / beta / factor) * factor)
        w_bar = max(least, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ImageTokenRule:
    """How an image becomes vision patches and LLM tokens (Qwen2-VL rule, see the module docstring; another
    processor's resize where `image_style` names another style of `mmpack.packing.image_rules`).

    The size fields fix the token count; `temporal_patch_size`, `image_mean`, `image_std`,
    `rescale_factor` and `resample` (a PIL resampling filter, 3 = bicubic) fix the pixel values, as in a
    Qwen2-VL `preprocessor_config.json` (`from_preprocessor_config`).
    """

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 3136
    max_pixels: int = 12845056
    max_aspect_ratio: float = 200
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3
    image_style: str = DEFAULT_IMAGE_STYLE  # whose resize: a name in `mmpack.packing.image_rules.IMAGE_RULES`

    def __post_init__(self) -> None:
        if self.patch_size < 1 or self.merge_size < 1 or self.temporal_patch_size < 1:
            raise ValueError(
                "patch_size, merge_size and temporal_patch_size must be >= 1, got "
                f"{self.patch_size}, {self.merge_size}, {self.temporal_patch_size}"
            )
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"need 0 < min_pixels <= max_pixels, got min_pixels={self.min_pixels}, "
                f"max_pixels={self.max_pixels}"
            )
        if not self.max_aspect_ratio >= 1:
            raise ValueError(f"max_aspect_ratio must be >= 1, got {self.max_aspect_ratio}")
        for name in ("image_mean", "image_std"):
            value = tuple(float(v) for v in getattr(self, name))  # JSON lists -> tuples, for equality
            if len(value) != 3 or (name == "image_std" and min(value) <= 0):
                raise ValueError(f"{name} must be 3 numbers (std > 0), got {getattr(self, name)}")
            object.__setattr__(self, name, value)
        if not self.rescale_factor > 0 or self.resample not in range(6):
            raise ValueError(
                f"need rescale_factor > 0 and resample in 0..5 (PIL filters), got {self.rescale_factor}, "
                f"{self.resample}"
            )
        self.kind.check(self)

    @property
    def kind(self) -> ImageStyle:
        """The style object of `image_style` (the registry's)."""
        return image_style(self.image_style)

    @property
    def factor(self) -> int:
        """Side granularity in pixels: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @cached_property
    def normalise_table(self) -> np.ndarray:
        """float32 [3, 256]: the normalised value of every 8-bit level per channel (made once per rule object).

        The same float operations transformers applies per pixel (rescale in float64, cast to float32,
        then (x - mean) / std in float32), done once per level: a gather then gives bit-identical values.
        """
        scaled = (np.arange(256, dtype=np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.asarray(self.image_mean, dtype=np.float32)[:, None]
        std = np.asarray(self.image_std, dtype=np.float32)[:, None]
        return (scaled[None, :] - mean) / std

    @property
    def patch_dim(self) -> int:
        """Width of one row of `pixel_values`: 3 * temporal_patch_size * patch_size**2."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def resized_hw(self, height: int, width: int) -> tuple[int, int]:
        """(h', w') the image is resized to, by its style; `ImageSizeError` (a ValueError) for too elongated
        images."""
        if height < 1 or width < 1:
            raise ImageSizeError("image_size_invalid", f"image of {width}x{height} (w x h) has no pixels")
        aspect = max(height, width) / min(height, width)
        if aspect > self.max_aspect_ratio:
            raise ImageSizeError(
                "image_aspect_ratio",
                f"image of {width}x{height} (w x h) has aspect ratio {aspect:.1f}, "
                f"above the limit of {self.max_aspect_ratio}",
            )
        return self.kind.resized_hw(self, height, width)

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) of the vision grid in patches (before the merge); t is 1 for images."""
        h_bar, w_bar = self.resized_hw(height, width)
        return 1, h_bar // self.patch_size, w_bar // self.patch_size

    def num_tokens(self, height: int, width: int) -> int:
        """LLM tokens (<|image_pad|> count) of an image of height x width pixels."""
        h_bar, w_bar = self.resized_hw(height, width)
        return (h_bar // self.factor) * (w_bar // self.factor)

    def tokens_of_grid(self, grid_thw: tuple[int, int, int]) -> int:
        """LLM tokens of a vision grid (t, h, w) in patches."""
        t, gh, gw = grid_thw
        return int(t * gh * gw) // (self.merge_size**2)

    def to_dict(self) -> dict[str, Any]:
        """The manifest's "image_rule" entry."""
        d = asdict(self)
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageTokenRule:
        """The rule of a manifest's "image_rule" entry (unknown keys are an error, missing ones default)."""
        return cls(**d)

    @classmethod
    def from_preprocessor_config(
        cls, config: dict[str, Any], *, source: str = "preprocessor_config"
    ) -> ImageTokenRule:
        """The rule of an image processor config (`preprocessor_config.json`, or `processor_config.json`'s
        `image_processor`), by the style that claims its `image_processor_type` (`mmpack.packing.image_rules`).

        Raises:
            ValueError: a processor type or setting no rule can reproduce, naming `source`.
        """
        style = style_of_processor(config, source)
        fields = style.rule_fields(config, source)
        try:
            return cls(**fields, image_style=style.name)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from exc


class Qwen2VLImageStyle(ImageStyle):
    """transformers' `Qwen2VLImageProcessor` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision): `smart_resize`
    (the module docstring), each image `<|vision_start|>` + N x `<|image_pad|>` + `<|vision_end|>`."""

    name = "qwen2_vl"

    def resized_hw(self, rule: Any, height: int, width: int) -> tuple[int, int]:
        return smart_resize(
            height, width, factor=rule.factor, min_pixels=rule.min_pixels, max_pixels=rule.max_pixels
        )

    def claims(self, config: Mapping[str, Any]) -> bool:
        kind = str(config.get("image_processor_type", "Qwen2VLImageProcessor"))
        return kind.startswith("Qwen2VLImageProcessor")

    def rule_fields(self, config: Mapping[str, Any], source: str) -> dict[str, Any]:
        """The fields of a Qwen2-VL `preprocessor_config.json`, read as transformers 5 reads it.

        `min_pixels`/`max_pixels` win over `size.shortest_edge`/`size.longest_edge` (transformers' order);
        keys absent from the file take `Qwen2VLImageProcessorPil`'s class defaults (max_pixels 28*28*1280,
        not the 12845056 Qwen2-VL checkpoints ship), since that is what the model's processor would use.
        """
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if config.get(flag, True) is not True:
                raise ValueError(f"{source}: {flag}={config[flag]!r} is not supported (mmpack needs true)")
        size = dict(config.get("size") or {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280})
        min_pixels = config.get("min_pixels", size.get("shortest_edge"))
        max_pixels = config.get("max_pixels", size.get("longest_edge"))
        if min_pixels is None or max_pixels is None:
            raise ValueError(
                f"{source}: size {size} needs both shortest_edge and longest_edge (or min_pixels/max_pixels)"
            )
        defaults = ImageTokenRule()
        try:
            return dict(
                patch_size=int(config.get("patch_size", defaults.patch_size)),
                merge_size=int(config.get("merge_size", defaults.merge_size)),
                temporal_patch_size=int(config.get("temporal_patch_size", defaults.temporal_patch_size)),
                min_pixels=int(min_pixels),
                max_pixels=int(max_pixels),
                image_mean=tuple(config.get("image_mean", defaults.image_mean)),
                image_std=tuple(config.get("image_std", defaults.image_std)),
                rescale_factor=float(config.get("rescale_factor", defaults.rescale_factor)),
                resample=int(config.get("resample", defaults.resample)),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from exc


IMAGE_STYLE = Qwen2VLImageStyle()
PREPROCESSOR_CONFIG = "preprocessor_config.json"
# transformers 5 saves a processor's settings (each sub-processor's under its own key) in this file
PROCESSOR_CONFIG = "processor_config.json"


def read_processor_config(model_dir: str | os.PathLike[str], name: str) -> tuple[str, dict[str, Any]] | None:
    """(path, JSON object) of a model folder's processor config file `name`; None when there is none."""
    import json

    path = os.path.join(os.fspath(model_dir), name)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return path, config


def image_processor_config(model_dir: str | os.PathLike[str]) -> tuple[str, dict[str, Any]] | None:
    """(where, settings) of a model folder's image processor: its `preprocessor_config.json`, else the
    `image_processor` of its `processor_config.json` (as transformers 5 saves a processor); None where it has
    neither."""
    found = read_processor_config(model_dir, PREPROCESSOR_CONFIG)
    if found is not None:
        return found
    found = read_processor_config(model_dir, PROCESSOR_CONFIG)
    if found is None or "image_processor" not in found[1]:
        return None
    path, config = found
    if not isinstance(config["image_processor"], dict):
        raise ValueError(f"{path}: image_processor is not a JSON object")
    return f"{path} image_processor", config["image_processor"]


def load_model_image_rule(model_dir: str | os.PathLike[str]) -> ImageTokenRule | None:
    """The rule of `model_dir`'s image processor config (`image_processor_config`); None when it has none."""
    found = image_processor_config(model_dir)
    if found is None:
        return None
    path, config = found
    return ImageTokenRule.from_preprocessor_config(config, source=path)


# --------------------------------------------------------------------------------------------------
# Header reading


def read_image_size(
    src: str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes],
    *,
    check_truncated: bool = True,
    max_image_pixels: int | None = None,
) -> tuple[int, int, str]:
    """(width, height, fmt) of an image from its header, without decoding the pixels.

    The format is detected from the content (never the file name); fmt is "jpg", "png", "webp", "gif", ...
    Width and height are those of the stored pixels (the EXIF orientation is not applied, as in
    `image_to_patches`). With `check_truncated`, a JPEG/PNG/GIF/WEBP whose end marker is missing is checked
    by a full decode, so truncated files fail here rather than in the loader.

    Raises:
        FileNotFoundError: `src` is a path that does not exist.
        ImageHeaderError: not an image Pillow can identify, or a truncated file.
        ImageSizeError: reason "image_too_large", more than `max_image_pixels` pixels (checked from the
            header, before any decode).
    """
    if isinstance(src, (bytes, bytearray, memoryview)):
        return _read_size(io.BytesIO(bytes(src)), "<bytes>", check_truncated, max_image_pixels)
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as f:
            return _read_size(f, os.fspath(src), check_truncated, max_image_pixels)
    name = str(getattr(src, "name", "<file object>"))
    if not (src.seekable() and src.tell() == 0):
        src = io.BytesIO(src.read())
    return _read_size(src, name, check_truncated, max_image_pixels)


def _too_large(name: str, pixels: str, limit: int) -> ImageSizeError:
    return ImageSizeError(
        "image_too_large",
        f"image {name} has {pixels} pixels, more than --max-image-pixels {limit}; downscale it or raise the limit",
    )


def _read_size(
    f: IO[bytes], name: str, check_truncated: bool, max_image_pixels: int | None = None
) -> tuple[int, int, str]:
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # the pixel limit is checked here; Pillow's bomb warning is noise
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(f) as im:
                pil_format = str(im.format)
                width, height = im.size
                if max_image_pixels is not None and width * height > max_image_pixels:
                    raise _too_large(name, f"{width}x{height}", max_image_pixels)
                if check_truncated and _looks_truncated(f, pil_format):
                    decode_or_raise(im, name)
    except Image.DecompressionBombError as exc:
        if max_image_pixels is not None:  # above Pillow's own hard limit, so above ours too
            raise _too_large(name, "over Pillow's limit of 2 x MAX_IMAGE_PIXELS", max_image_pixels) from exc
        raise ImageHeaderError(f"cannot read image header of {name}: {exc}") from exc
    except (UnidentifiedImageError, SyntaxError, struct.error) as exc:
        raise ImageHeaderError(f"cannot read image header of {name}: {exc}") from exc
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ImageHeaderError(f"cannot read image {name}: {exc}") from exc
    fmt = _FORMAT_NAMES.get(pil_format, pil_format.lower())
    return int(width), int(height), fmt


def _looks_truncated(f: IO[bytes], pil_format: str) -> bool:
    """Cheap end-of-file check; a False here is final, a True is confirmed by a decode."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    if pil_format in ("JPEG", "MPO"):
        f.seek(max(0, size - 2))
        return f.read(2) != b"\xff\xd9"
    if pil_format == "PNG":
        f.seek(max(0, size - len(_PNG_IEND)))
        return f.read(len(_PNG_IEND)) != _PNG_IEND
    if pil_format == "GIF":
        f.seek(max(0, size - 1))
        return f.read(1) != b"\x3b"
    if pil_format == "WEBP":
        f.seek(4)
        (riff_size,) = struct.unpack("<I", f.read(4))
        return riff_size + 8 > size
    return False


def decode_or_raise(im: Any, name: str) -> None:
    """Fully decode an opened PIL image; `ImageHeaderError` (a ValueError) if it is truncated or corrupt."""
    from PIL import ImageFile

    previous = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        im.load()
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageHeaderError(f"image {name} is truncated or corrupt: {exc}") from exc
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = previous


# --------------------------------------------------------------------------------------------------
# Pixels


def image_to_patches(
    img: Any, rule: ImageTokenRule, *, grid_thw: tuple[int, int, int] | None = None
) -> np.ndarray:
    """Pixel patches of a PIL image: float32 [gh * gw, 3 * temporal_patch_size * patch**2].

    Equal to transformers' `Qwen2VLImageProcessorPil` on the same PIL image (no EXIF orientation):
    transparency composited onto white, other modes converted to RGB, resized with the `rule`'s filter
    (bicubic) to the rule's (h', w') (or to `grid_thw` * patch when given, e.g. from a manifest), scaled by
    `rescale_factor` (in float64, then float32) and normalised with `image_mean`/`image_std` in float32.

    Row order is merge-window-major: windows of merge x merge patches in row-major order, and inside
    a window its patches in row-major order, so the merge is a reshape of groups of merge**2 rows.
    Row r = ((wy * (gw // m) + wx) * m + dy) * m + dx holds patch (py, px) = (wy * m + dy, wx * m + dx).
    Each row is laid out (channel, t, y, x): the single image repeated temporal_patch_size times.
    `patches_to_image` is the inverse.
    """
    p, m, t = rule.patch_size, rule.merge_size, rule.temporal_patch_size
    if grid_thw is None:
        width, height = img.size
        _, gh, gw = rule.grid_thw(height, width)
    else:
        _, gh, gw = (int(v) for v in grid_thw)
        if gh % m or gw % m or gh < m or gw < m:
            raise ValueError(f"grid {tuple(grid_thw)} is not a positive multiple of merge_size {m}")
    rgb = _to_rgb(img).resize((gw * p, gh * p), resample=rule.resample)
    pixels = np.asarray(rgb, dtype=np.uint8)  # [H, W, 3]
    # [H, W, C] -> [wy, dy, py, wx, dx, px, C] -> [wy, wx, dy, dx, C, py, px], still uint8 (cheap to move)
    blocks = pixels.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    blocks = blocks.reshape(gh * gw, 3, 1, p, p)
    out = np.empty((gh * gw, 3, t, p, p), dtype=np.float32)
    out[:] = rule.normalise_table[np.arange(3).reshape(1, 3, 1, 1, 1), blocks]
    return out.reshape(gh * gw, rule.patch_dim)


def patches_to_image(patches: np.ndarray, grid_thw: tuple[int, int, int], rule: ImageTokenRule) -> np.ndarray:
    """Inverse of the layout of `image_to_patches`: float32 [3, gh * patch, gw * patch] (still normalised).

    The first temporal copy is used; `ValueError` if the copies differ (not an image's patches).
    """
    p, m, t = rule.patch_size, rule.merge_size, rule.temporal_patch_size
    _, gh, gw = (int(v) for v in grid_thw)
    if patches.shape != (gh * gw, rule.patch_dim):
        raise ValueError(f"patches of shape {patches.shape} do not match grid {tuple(grid_thw)}")
    frames = patches.reshape(gh // m, gw // m, m, m, 3, t, p, p)  # [wy, wx, dy, dx, C, T, py, px]
    if not (frames == frames[:, :, :, :, :, :1]).all():
        raise ValueError("the temporal copies of these patches differ: they are not one image's patches")
    blocks = frames[:, :, :, :, :, 0]
    return np.ascontiguousarray(blocks.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * p, gw * p))


def _to_rgb(img: Any) -> Any:
    """RGB PIL image as transformers' `convert_to_rgb`: any transparency composited onto white."""
    from PIL import Image

    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")
