"""Image-token rule (Qwen2-VL `smart_resize`), image size from headers, and image -> patch pixels.

The offline packer counts the tokens of an image with `ImageTokenRule.num_tokens(h, w)` on the size that
`read_image_size` reads from the header; the loader turns the same bytes into pixel patches with
`image_to_patches`. Both sides honour the EXIF orientation the same way (JPEG/WEBP/MPO only, read from the
header), so the count offline equals what the loader produces, exactly.

Resize rule (Qwen2-VL, factor = patch_size * merge_size)::

    reject if min(h, w) < factor                 (as Qwen2-VL's image processor does)
    reject if max(h, w) / min(h, w) > max_aspect_ratio
    h', w' = round(h / factor) * factor, round(w / factor) * factor     (Python round: half to even)
    if h' * w' > max_pixels:  beta = sqrt(h * w / max_pixels)
                              h', w' = floor(h / beta / factor) * factor, ... (at least factor)
    elif h' * w' < min_pixels: beta = sqrt(min_pixels / (h * w))
                              h', w' = ceil(h * beta / factor) * factor, ...

Tokens = (h' / factor) * (w' / factor); the vision grid is (1, h' / patch, w' / patch) patches.
"""

from __future__ import annotations

import io
import math
import os
import struct
from dataclasses import asdict, dataclass
from typing import IO, Any

import numpy as np

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_FORMAT_NAMES = {"JPEG": "jpg", "MPO": "jpg", "TIFF": "tiff"}
_ORIENTATION_TAG = 0x0112
_ORIENTED_FORMATS = ("JPEG", "MPO", "WEBP")  # EXIF available from the header, no decode needed
_PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"


class ImageHeaderError(ValueError):
    """An image whose header cannot be read, or whose file is truncated."""


class ImageSizeError(ValueError):
    """An image size the rule refuses; `reason` is "image_too_small" or "image_aspect_ratio"."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ImageTokenRule:
    """How many LLM tokens an image of a given size becomes (Qwen2-VL rule; see the module docstring)."""

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 3136
    max_pixels: int = 12845056
    max_aspect_ratio: float = 200

    def __post_init__(self) -> None:
        if self.patch_size < 1 or self.merge_size < 1:
            raise ValueError(
                f"patch_size and merge_size must be >= 1, got {self.patch_size}, {self.merge_size}"
            )
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"need 0 < min_pixels <= max_pixels, got min_pixels={self.min_pixels}, "
                f"max_pixels={self.max_pixels}"
            )
        if not self.max_aspect_ratio >= 1:
            raise ValueError(f"max_aspect_ratio must be >= 1, got {self.max_aspect_ratio}")

    @property
    def factor(self) -> int:
        """Side granularity in pixels: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    def resized_hw(self, height: int, width: int) -> tuple[int, int]:
        """(h', w') the image is resized to; `ImageSizeError` (a ValueError) for too small or too elongated images."""
        factor = self.factor
        if height < factor or width < factor:
            raise ImageSizeError(
                "image_too_small",
                f"image of {width}x{height} (w x h) is too small: both sides must be at least {factor} pixels",
            )
        aspect = max(height, width) / min(height, width)
        if aspect > self.max_aspect_ratio:
            raise ImageSizeError(
                "image_aspect_ratio",
                f"image of {width}x{height} (w x h) has aspect ratio {aspect:.1f}, "
                f"above the limit of {self.max_aspect_ratio}",
            )
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

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
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageTokenRule:
        """The rule of a manifest's "image_rule" entry (unknown keys are an error, missing ones default)."""
        return cls(**d)


# --------------------------------------------------------------------------------------------------
# Header reading


def read_image_size(
    src: str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes], *, check_truncated: bool = True
) -> tuple[int, int, str]:
    """(width, height, fmt) of an image from its header, without decoding the pixels.

    The format is detected from the content (never the file name); fmt is "jpg", "png", "webp", "gif", ...
    Width and height are as displayed, i.e. after the EXIF orientation (JPEG/WEBP), matching
    `image_to_patches`. With `check_truncated`, a JPEG/PNG/GIF/WEBP whose end marker is missing is checked
    by a full decode, so truncated files fail here rather than in the loader.

    Raises:
        FileNotFoundError: `src` is a path that does not exist.
        ImageHeaderError: not an image Pillow can identify, or a truncated file.
    """
    if isinstance(src, (bytes, bytearray, memoryview)):
        return _read_size(io.BytesIO(bytes(src)), "<bytes>", check_truncated)
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as f:
            return _read_size(f, os.fspath(src), check_truncated)
    name = str(getattr(src, "name", "<file object>"))
    if not (src.seekable() and src.tell() == 0):
        src = io.BytesIO(src.read())
    return _read_size(src, name, check_truncated)


def _read_size(f: IO[bytes], name: str, check_truncated: bool) -> tuple[int, int, str]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(f) as im:
            pil_format = str(im.format)
            width, height = im.size
            transposed = _orientation_swaps_axes(im)
            if check_truncated and _looks_truncated(f, pil_format):
                decode_or_raise(im, name)
    except (UnidentifiedImageError, SyntaxError, struct.error, Image.DecompressionBombError) as exc:
        raise ImageHeaderError(f"cannot read image header of {name}: {exc}") from exc
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ImageHeaderError(f"cannot read image {name}: {exc}") from exc
    if transposed:
        width, height = height, width
    fmt = _FORMAT_NAMES.get(pil_format, pil_format.lower())
    return int(width), int(height), fmt


def _orientation_swaps_axes(im: Any) -> bool:
    """True when the EXIF orientation rotates the image by 90 or 270 degrees (tags 5..8)."""
    return _exif_orientation(im) in (5, 6, 7, 8)


def _exif_orientation(im: Any) -> int:
    if im.format not in _ORIENTED_FORMATS:
        return 1
    try:
        value = im.getexif().get(_ORIENTATION_TAG, 1)
    except Exception:  # a corrupt EXIF block is ignored, like most image viewers do
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


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
    """Pixel patches of a PIL image: float32 [gh * gw, 3 * patch * patch], CLIP-normalised.

    The image is EXIF-oriented (as in `read_image_size`), converted to RGB, resized with bicubic
    resampling to the `rule`'s (h', w') (or to `grid_thw` * patch when given, e.g. from a manifest),
    scaled to [0, 1] and normalised with the CLIP mean/std.

    Row order is merge-window-major: windows of merge x merge patches in row-major order, and inside
    a window its patches in row-major order, so the merge is a reshape of groups of merge**2 rows.
    Row r = ((wy * (gw // m) + wx) * m + dy) * m + dx holds patch (py, px) = (wy * m + dy, wx * m + dx).
    Each row is laid out (channel, y, x) inside the patch. `patches_to_image` is the inverse.
    """
    from PIL import Image

    p, m = rule.patch_size, rule.merge_size
    img = _apply_orientation(img)
    if grid_thw is None:
        width, height = img.size
        _, gh, gw = rule.grid_thw(height, width)
    else:
        _, gh, gw = (int(v) for v in grid_thw)
        if gh % m or gw % m or gh < m or gw < m:
            raise ValueError(f"grid {tuple(grid_thw)} is not a positive multiple of merge_size {m}")
    rgb = img.convert("RGB").resize((gw * p, gh * p), resample=Image.Resampling.BICUBIC)
    scaled = np.asarray(rgb, dtype=np.float32) * np.float32(1.0 / 255.0)  # [H, W, 3]
    normalised = (scaled - np.asarray(CLIP_MEAN, np.float32)) / np.asarray(CLIP_STD, np.float32)
    # [H, W, C] -> [wy, dy, py, wx, dx, px, C] -> [wy, wx, dy, dx, C, py, px]
    blocks = normalised.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    return np.ascontiguousarray(blocks.reshape(gh * gw, 3 * p * p), dtype=np.float32)


def patches_to_image(patches: np.ndarray, grid_thw: tuple[int, int, int], rule: ImageTokenRule) -> np.ndarray:
    """Inverse of the layout of `image_to_patches`: float32 [3, gh * patch, gw * patch] (still normalised)."""
    p, m = rule.patch_size, rule.merge_size
    _, gh, gw = (int(v) for v in grid_thw)
    if patches.shape != (gh * gw, 3 * p * p):
        raise ValueError(f"patches of shape {patches.shape} do not match grid {tuple(grid_thw)}")
    blocks = patches.reshape(gh // m, gw // m, m, m, 3, p, p)  # [wy, wx, dy, dx, C, py, px]
    return np.ascontiguousarray(blocks.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * p, gw * p))


def _apply_orientation(img: Any) -> Any:
    from PIL import Image

    orientation = _exif_orientation(img)
    method = {
        2: Image.Transpose.FLIP_LEFT_RIGHT,
        3: Image.Transpose.ROTATE_180,
        4: Image.Transpose.FLIP_TOP_BOTTOM,
        5: Image.Transpose.TRANSPOSE,
        6: Image.Transpose.ROTATE_270,
        7: Image.Transpose.TRANSVERSE,
        8: Image.Transpose.ROTATE_90,
    }.get(orientation)
    return img if method is None else img.transpose(method)
