"""The loader's pixels equal transformers' `Qwen2VLImageProcessorPil` for the same image bytes.

The reference is the processor applied to `Image.open(BytesIO(data))` (its Pillow backend, no torchvision);
mmpack's side is the packer's header read (`read_image_size` -> `rule.grid_thw`) followed by the loader's
decode (`mmpack.dataloader.collate.decode_image_patches`), so token counts offline and pixels in the loader are both
checked. Controls (channel order, resampling filter, dropped alpha, EXIF applied) show the comparison fails
when the pipeline differs.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil_processor

from mmpack.dataloader.collate import decode_image_patches
from mmpack.packing.image_tokens import (
    ImageTokenRule,
    image_to_patches,
    load_model_image_rule,
    read_image_size,
)

TOL = 1e-5
RULES = {
    "default": ImageTokenRule(),
    "max50176": ImageTokenRule(max_pixels=50176),
    "min200k": ImageTokenRule(min_pixels=200_704, max_pixels=401_408),  # forces upscaling
}


def reference_processor(rule: ImageTokenRule) -> Any:
    return pil_processor.Qwen2VLImageProcessorPil(
        min_pixels=rule.min_pixels,
        max_pixels=rule.max_pixels,
        patch_size=rule.patch_size,
        merge_size=rule.merge_size,
        temporal_patch_size=rule.temporal_patch_size,
        image_mean=list(rule.image_mean),
        image_std=list(rule.image_std),
        resample=rule.resample,
    )


def reference(data: bytes, processor: Any) -> tuple[np.ndarray, np.ndarray]:
    out = processor(images=Image.open(io.BytesIO(data)), return_tensors="np")
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def mmpack_pixels(data: bytes, rule: ImageTokenRule) -> tuple[np.ndarray, np.ndarray]:
    """Packer (header -> grid, as stored in the bin) then loader (bytes + stored grid -> patches)."""
    width, height, _ = read_image_size(data)
    grid = np.asarray(rule.grid_thw(height, width), dtype=np.int32)
    return decode_image_patches(data, grid, rule), grid[None].astype(np.int64)


def assert_parity(data: bytes, rule: ImageTokenRule, processor: Any = None) -> None:
    ref_pixels, ref_grid = reference(data, processor or reference_processor(rule))
    got_pixels, got_grid = mmpack_pixels(data, rule)
    np.testing.assert_array_equal(got_grid, ref_grid)
    width, height, _ = read_image_size(data)
    assert rule.num_tokens(height, width) == int(ref_grid.prod()) // rule.merge_size**2  # offline count
    assert got_pixels.shape == ref_pixels.shape == (int(ref_grid.prod()), rule.patch_dim)
    assert got_pixels.dtype == np.float32
    diff = float(np.abs(got_pixels - ref_pixels).max())
    assert diff <= TOL, f"max abs difference {diff}"


def encode(img: Image.Image, fmt: str, **save: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return buf.getvalue()


def synthetic_rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth gradients plus noise: resampling filters give visibly different results on it."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    noisy = base + rng.normal(0, 25, base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def with_alpha(img: Image.Image, seed: int = 1) -> Image.Image:
    rng = np.random.default_rng(seed)
    alpha = rng.integers(0, 256, (img.height, img.width), dtype=np.uint8)
    alpha[: img.height // 3] = 0  # fully transparent band
    rgba = img.convert("RGBA")
    rgba.putalpha(Image.fromarray(alpha))
    return rgba


def palette_with_transparency(img: Image.Image) -> Image.Image:
    pal = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    pal.info["transparency"] = 3  # palette entry 3 is transparent
    return pal


def cmyk_jpeg(img: Image.Image) -> bytes:
    return encode(img.convert("CMYK"), "JPEG", quality=90)


def exif_rotated_jpeg(img: Image.Image, orientation: int = 6) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(img, "JPEG", quality=90, exif=exif.tobytes())


# name -> bytes, from a base RGB image
VARIANTS: dict[str, Callable[[Image.Image], bytes]] = {
    "jpeg": lambda im: encode(im, "JPEG", quality=85),
    "png": lambda im: encode(im, "PNG"),
    "webp_lossy": lambda im: encode(im, "WEBP", quality=80),
    "webp_lossless": lambda im: encode(im, "WEBP", lossless=True),
    "png_rgba": lambda im: encode(with_alpha(im), "PNG"),
    "webp_rgba": lambda im: encode(with_alpha(im), "WEBP", lossless=True),
    "png_la": lambda im: encode(with_alpha(im).convert("LA"), "PNG"),
    "png_palette": lambda im: encode(im.convert("P", palette=Image.Palette.ADAPTIVE, colors=32), "PNG"),
    "png_palette_transparent": lambda im: encode(palette_with_transparency(im), "PNG"),
    "gif_transparent": lambda im: encode(palette_with_transparency(im), "GIF"),
    "png_gray": lambda im: encode(im.convert("L"), "PNG"),
    "jpeg_gray": lambda im: encode(im.convert("L"), "JPEG", quality=90),
    "jpeg_cmyk": cmyk_jpeg,
    "png_rgb_trns": lambda im: encode(im, "PNG", transparency=tuple(int(v) for v in im.getpixel((0, 0)))),
    "jpeg_exif_rotated": exif_rotated_jpeg,
    "jpeg_exif_rotated180": lambda im: exif_rotated_jpeg(im, 3),
}

SIZES = {
    "odd": (301, 167),
    "tiny": (5, 7),
    "one_pixel": (1, 1),
    "below_factor": (27, 90),
    "elongated_wide": (2000, 11),
    "elongated_tall": (30, 4000),
    "large": (1500, 1100),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_synthetic_formats_and_modes(variant: str, rule_name: str) -> None:
    data = VARIANTS[variant](synthetic_rgb(173, 131, seed=len(variant)))
    assert_parity(data, RULES[rule_name])


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("variant", ["jpeg", "png_rgba", "webp_lossy"])
def test_odd_tiny_elongated_sizes(size: str, variant: str) -> None:
    width, height = SIZES[size]
    data = VARIANTS[variant](synthetic_rgb(width, height, seed=width))
    for rule in RULES.values():
        assert_parity(data, rule)


@pytest.fixture(scope="module")
def demo_images() -> list[bytes]:
    from tests.support.shared import MLLM_DEMO_JSON, need_shared

    folder = MLLM_DEMO_JSON.parent / "mllm_demo_data"
    need_shared(folder, what="the mllm_demo images")
    files = sorted(folder.glob("*.jpg"))
    assert files, f"no JPEG in {folder}"
    return [f.read_bytes() for f in files]


@pytest.mark.shared
@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_real_jpegs(demo_images: list[bytes], rule_name: str) -> None:
    for data in demo_images:
        assert_parity(data, RULES[rule_name])


@pytest.mark.shared
@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - {"jpeg"}))
def test_real_images_reencoded(demo_images: list[bytes], variant: str) -> None:
    rule = RULES["max50176"]
    for data in demo_images:
        assert_parity(VARIANTS[variant](Image.open(io.BytesIO(data)).convert("RGB")), rule)


def test_model_folder_rule_matches_processor_from_pretrained(tmp_path: Path) -> None:
    """A non-default processor (patch 16, mean 0.5, bilinear, no temporal repeat) saved and read back."""
    saved = pil_processor.Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=1,
        min_pixels=4096,
        max_pixels=160_000,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        resample=2,
    )
    saved.save_pretrained(str(tmp_path))
    rule = load_model_image_rule(tmp_path)
    assert rule == ImageTokenRule(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=1,
        min_pixels=4096,
        max_pixels=160_000,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
        resample=2,
    )
    loaded = pil_processor.Qwen2VLImageProcessorPil.from_pretrained(str(tmp_path))
    for variant in ("jpeg", "png_rgba", "webp_lossy"):
        assert_parity(VARIANTS[variant](synthetic_rgb(333, 211)), rule, loaded)


@pytest.mark.parametrize(
    ("config", "min_pixels", "max_pixels"),
    [
        ({"min_pixels": 3136, "max_pixels": 12845056}, 3136, 12845056),  # Qwen2-VL checkpoints
        ({"size": {"shortest_edge": 1000, "longest_edge": 70000}}, 1000, 70000),  # transformers 5 writes
        ({"max_pixels": 50176, "size": {"shortest_edge": 3136, "longest_edge": 12845056}}, 3136, 50176),
        ({}, 3136, 28 * 28 * 1280),  # transformers 5's class default, not the checkpoints' value
    ],
)
def test_min_max_pixels_read_as_transformers_reads_them(
    tmp_path: Path, config: dict, min_pixels: int, max_pixels: int
) -> None:
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "Qwen2VLImageProcessor", **config})
    )
    rule = load_model_image_rule(tmp_path)
    assert rule is not None and (rule.min_pixels, rule.max_pixels) == (min_pixels, max_pixels)
    loaded = pil_processor.Qwen2VLImageProcessorPil.from_pretrained(str(tmp_path))
    assert (loaded.size["shortest_edge"], loaded.size["longest_edge"]) == (min_pixels, max_pixels)


def test_preprocessor_config_errors(tmp_path: Path) -> None:
    assert load_model_image_rule(tmp_path) is None
    cfg = tmp_path / "preprocessor_config.json"
    for bad, match in [
        ({"image_processor_type": "CLIPImageProcessor"}, "not a Qwen2-VL"),
        ({"do_normalize": False}, "do_normalize"),
        ({"size": {"longest_edge": 5000}}, "shortest_edge"),
        ({"image_mean": [0.5, 0.5]}, "image_mean"),
    ]:
        cfg.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match) as info:
            load_model_image_rule(tmp_path)
        assert str(cfg) in str(info.value)
    cfg.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_model_image_rule(tmp_path)


# ---------------------------------------------------------------- controls


def _max_diff_to_reference(
    data: bytes, rule: ImageTokenRule, transform: Callable[[Image.Image], Image.Image]
) -> float:
    ref_pixels, ref_grid = reference(data, reference_processor(rule))
    img = transform(Image.open(io.BytesIO(data)))
    got = image_to_patches(img, rule, grid_thw=tuple(int(v) for v in ref_grid[0]))
    return float(np.abs(got - ref_pixels).max())


def _bgr(img: Image.Image) -> Image.Image:
    r, g, b = img.convert("RGB").split()
    return Image.merge("RGB", (b, g, r))


def _alpha_dropped(img: Image.Image) -> Image.Image:
    return img.convert("RGB")  # no compositing onto white: transparent pixels keep their colour


def _exif_applied(img: Image.Image) -> Image.Image:
    from PIL import ImageOps

    return ImageOps.exif_transpose(img)


@pytest.mark.parametrize(
    ("variant", "transform", "rule"),
    [
        ("jpeg", _bgr, ImageTokenRule()),
        ("jpeg", lambda im: im, ImageTokenRule(resample=2)),  # bilinear instead of the reference's bicubic
        ("jpeg", lambda im: im, ImageTokenRule(image_mean=(0.5, 0.5, 0.5))),
        ("png_rgba", _alpha_dropped, ImageTokenRule()),
        ("jpeg_exif_rotated", _exif_applied, ImageTokenRule()),
        ("jpeg_exif_rotated180", _exif_applied, ImageTokenRule()),
    ],
)
def test_controls_detect_a_different_pipeline(
    variant: str, transform: Callable[[Image.Image], Image.Image], rule: ImageTokenRule
) -> None:
    data = VARIANTS[variant](synthetic_rgb(173, 131))
    reference_rule = ImageTokenRule()  # the reference processor always runs with the default rule
    ref_pixels, ref_grid = reference(data, reference_processor(reference_rule))
    img = transform(Image.open(io.BytesIO(data)))
    width, height = img.size
    grid = rule.grid_thw(height, width)
    got = image_to_patches(img, rule, grid_thw=grid)
    if got.shape != ref_pixels.shape:  # EXIF rotation by 90 degrees changes the grid itself
        assert tuple(ref_grid[0]) != grid
        return
    assert float(np.abs(got - ref_pixels).max()) > 100 * TOL
    # and the faithful pipeline on the same bytes is within tolerance
    assert _max_diff_to_reference(data, reference_rule, lambda im: im) <= TOL
