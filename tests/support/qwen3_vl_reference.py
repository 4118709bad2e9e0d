"""transformers' Qwen3-VL processing as the reference for the packer's counts, run from transformers' own code.

transformers' `Qwen3VLVideoProcessor` needs torchvision for its pixels, which does not import here. What is
transformers': the video metadata (`transformers.video_utils.load_video`, PyAV backend), the frame sampling
(`Qwen3VLVideoProcessor.sample_frames`), the frame size (the module's `smart_resize`, as its `resize` calls it)
and patch count (`get_num_of_video_patches`), the text expansion with timestamps
(`Qwen3VLProcessor.replace_video_token` / `get_text_with_replacements`), the tokenizer, the image counts
(`Qwen2VLImageProcessorPil`, Qwen3-VL's image rule with the PIL backend) and `create_mm_token_type_ids`.
Ours (harness only): loading the video processor module from its file (the package's lazy import refuses
it without torchvision) and building `Qwen3VLProcessor` without its class check of the sub-processors.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from functools import cache
from pathlib import Path
from typing import Any

# A Qwen3-VL model folder's processor configs (the shape of Qwen/Qwen3-VL-*-Instruct's files)
IMAGE_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
VIDEO_CONFIG = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 4096, "longest_edge": 25165824},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


@cache
def video_processing_module() -> Any:
    """transformers' `video_processing_qwen3_vl` module, loaded from its file."""
    import transformers

    path = Path(transformers.__file__).parent / "models" / "qwen3_vl" / "video_processing_qwen3_vl.py"
    name = "transformers.models.qwen3_vl._video_processing_from_file"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def image_processor(config: dict[str, Any] = IMAGE_CONFIG) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    kwargs = {k: v for k, v in config.items() if k != "image_processor_type"}
    return Qwen2VLImageProcessorPil(**kwargs)


def processor(tokenizer_file: str | os.PathLike[str], video_config: dict[str, Any] = VIDEO_CONFIG) -> Any:
    """transformers' `Qwen3VLProcessor` over the Qwen3 tokenizer and the image and video processors."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    kwargs = {k: v for k, v in video_config.items() if k != "video_processor_type"}
    video = video_processing_module().Qwen3VLVideoProcessor(**kwargs)
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None  # type: ignore[method-assign]
    try:
        return Qwen3VLProcessor(image_processor=image_processor(), tokenizer=tokenizer, video_processor=video)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check  # type: ignore[method-assign]


@cache
def _metadata(path: str) -> Any:
    from transformers.video_utils import load_video

    return load_video(path, backend="pyav")[1]


def video_inputs(proc: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    """What the video processor returns for one video, less its pixels: `video_grid_thw` and the metadata
    with the sampled frames, from transformers' own sampling and sizing."""
    import copy

    import torch

    vp = proc.video_processor
    metadata = copy.copy(_metadata(str(path)))
    indices = vp.sample_frames(metadata)
    metadata.frames_indices = indices
    height, width = video_processing_module().smart_resize(
        num_frames=len(indices), height=metadata.height, width=metadata.width,
        temporal_factor=vp.temporal_patch_size, factor=vp.patch_size * vp.merge_size,
        min_pixels=vp.size["shortest_edge"], max_pixels=vp.size["longest_edge"],
    )  # fmt: skip
    t = -(-len(indices) // vp.temporal_patch_size)
    grid = torch.tensor([[t, height // vp.patch_size, width // vp.patch_size]])
    patches = vp.get_num_of_video_patches(len(indices), metadata.height, metadata.width)
    assert patches == int(grid.prod()), (patches, grid)  # the processor's own count agrees
    return {"video_grid_thw": grid, "video_metadata": [metadata], "frames": [int(i) for i in indices]}


def expand_text(proc: Any, text: str, videos: list[dict[str, Any]]) -> list[int]:
    """Token ids of `text` (one `<|video_pad|>` per video) expanded by the processor for `videos`."""
    replacements = [proc.replace_video_token(v, video_idx=0) for v in videos]
    [expanded], _ = proc.get_text_with_replacements([text], [], replacements, [])
    return list(proc.tokenizer(expanded)["input_ids"])
