"""A LLaVA-OneVision-2 codec video's blob (`mmpack.packing.video_codec_ov2.pack_codec_blob`) -> tower inputs, in
the loader's workers: the canvases' patches in processor order as one grid row [N, h, w] (canvas after canvas,
each in merge-block order) and each patch's block-ordered source (frame, row, column), which the tower turns
into its rotary angles in place of the canvas grid's own positions.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from mmpack.dataloader.video import VideoDecodeError, VideoPixels
from mmpack.packing.image_tokens import ImageTokenRule, image_to_patches
from mmpack.packing.video_codec_ov2 import CodecAssetError, read_codec_blob
from mmpack.packing.video_tokens import VideoPlan


def load_codec_video(blob: bytes, plan: VideoPlan, rule: ImageTokenRule, *, name: str) -> VideoPixels:
    """The canvases' patches, grid and source positions of one codec video (VideoDecodeError naming `name`
    where the blob does not match its plan)."""
    try:
        canvases, positions = read_codec_blob(blob, name)
    except CodecAssetError as exc:
        raise VideoDecodeError(exc.message) from None
    n, gh, gw = plan.grid_thw
    if len(canvases) != n or positions.shape != (n * gh * gw, 3):
        raise VideoDecodeError(
            f"codec video {name}: {len(canvases)} canvases and {positions.shape[0]} positions, its plan's grid "
            f"{plan.grid_thw} needs {n} and {n * gh * gw}; repack the data"
        )
    patches = []
    for k, data in enumerate(canvases):
        with Image.open(io.BytesIO(data)) as img:
            if img.size != (gw * rule.patch_size, gh * rule.patch_size):
                raise VideoDecodeError(
                    f"codec video {name}: canvas {k} is {img.size[0]}x{img.size[1]} (w x h), its plan's "
                    f"{gw * rule.patch_size}x{gh * rule.patch_size}; repack the data"
                )
            img.load()
            patches.append(image_to_patches(img, rule, grid_thw=(1, gh, gw)))
    return VideoPixels(np.concatenate(patches), (n, gh, gw), plan.second_per_grid_t, positions)
