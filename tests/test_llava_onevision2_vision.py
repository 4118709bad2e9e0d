"""The OneVision-Encoder's attention windows of ``frame_windows_size`` frames, against the reference
``LlavaOnevision2VisionPretrainedModel`` (../shared/reference/llava_onevision2, loaded in tests only).

- ``window_lengths`` is the reference's ``_build_cu_seqlens`` (as lengths) on grids of 1 to 13 frames, for
  windows of 0 (none), 1, 2, 4 and 5 frames;
- the tower, built on one gloo rank from a tiny HF folder of the reference classes (its weights through the
  family's HF rules), gives the reference tower's merged features for a 9-frame grid (windows of 4, 4, 1
  frames) and an image in one call, at patch 14 / merge 2 and patch 16 / merge 3; controls: the reference
  with windows of 0 or 2 frames, or with zeroed patch positions, gives features far from ours.

The trainer's videos reach the tower one frame per grid row (t = 1), so only a direct call has t > 1.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support import onevision
from tests.support.shared import REFERENCE_DIR, need_shared

pytestmark = [pytest.mark.family, pytest.mark.shared]

GRIDS = [[1, 4, 6], [9, 4, 4], [4, 2, 2], [5, 6, 4], [8, 2, 6], [13, 4, 2], [2, 2, 2], [3, 6, 6]]


def _reference_vision_class() -> Any:
    need_shared(REFERENCE_DIR / "llava_onevision2", what="the OneVision-2 reference")
    return onevision.reference_modules()[1].LlavaOnevision2VisionPretrainedModel


def _reference_lengths(grids: list[list[int]], frames: int) -> list[int]:
    """The reference's window lengths (``_build_cu_seqlens`` reads only its arguments)."""
    grid = torch.tensor(grids)
    cu, _ = _reference_vision_class()._build_cu_seqlens(
        None, grid, int(grid.prod(-1).sum()), fixed_t=frames, device=torch.device("cpu")
    )
    return torch.diff(cu).tolist()


@pytest.mark.parametrize("frames", [0, 1, 2, 4, 5])
def test_window_lengths_are_the_reference_cu_seqlens(frames: int) -> None:
    from mmpack.trainer.models.llava_onevision2.vision import window_lengths

    ours = window_lengths(np.asarray(GRIDS, dtype=np.int64), frames).tolist()
    assert ours == _reference_lengths(GRIDS, frames)
    for grid in GRIDS:  # one grid at a time as well
        assert window_lengths(np.asarray([grid]), frames).tolist() == _reference_lengths([grid], frames)
    # control: another window size is told apart on the same grids
    assert ours != _reference_lengths(GRIDS, frames + 3)


# -- the tower against the reference's ------------------------------------------------------------------


def _our_features(hf_dir: Path, pixels: torch.Tensor, grid: torch.Tensor, positions: torch.Tensor) -> Any:
    """The family's tower (the HF folder's weights) on the inputs: [P / m^2, out] merged features."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.config import RunConfig, build_megatron_configs
    from mmpack.trainer.export_check import one_rank_group
    from mmpack.trainer.models import family_of, read_hf_config

    hf_config = read_hf_config(hf_dir)
    fam = family_of(hf_config)
    arch = fam.arch_from_hf_config(hf_config)
    cpu_backend.activate()  # the test is the entry point: it sets up the CPU backend (no CUDA)
    with one_rank_group():
        ps.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        stage = fam.build_stage(arch, build_megatron_configs(RunConfig(), arch).model, pre_process=True,
                                post_process=True)  # fmt: skip
        fam.hf.load_stage_weights(stage, hf_dir, arch, tp_rank=0, tp_size=1)
        stage.eval()
        with torch.no_grad():
            return stage.vision(pixels, grid, positions)


@pytest.fixture(scope="module", params=[(14, 2), (16, 3)], ids=["patch14_merge2", "patch16_merge3"])
def hf_folder(request: pytest.FixtureRequest, onevision2_model: Callable[..., Path]) -> Path:
    """The session's tiny OneVision-2 of that patch and merge size (those of the trainer test's two
    datasets: patch 16 / merge 3 reads images up to 100352 pixels, which the tower test does not use)."""
    patch, merge = request.param
    return onevision2_model(patch_size=patch, merge_size=merge, max_pixels=50176 if patch == 14 else 100352)


def _gap(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest difference relative to the largest reference value."""
    return float((ours - theirs).abs().max() / theirs.abs().max())


@pytest.mark.slow
def test_tower_attends_within_frame_windows_as_the_reference(hf_folder: Path) -> None:
    from mmpack.packing.patch_positions import block_patch_positions

    _, _, video = onevision.reference_modules()
    v = json.loads((hf_folder / "config.json").read_text())["vision_config"]
    patch, merge = v["patch_size"], v["spatial_merge_size"]
    assert v["frame_windows_size"] == 4
    grid = torch.tensor([[9, 2 * merge, 2 * merge], [1, 2 * merge, 3 * merge]])  # a video, then an image
    # frames at the indices a sampler picks (t: the frame's index in the video), the image at t = 0
    positions = video.build_patch_positions(
        grid, spatial_merge_size=merge, frame_indices=[torch.arange(9) * 3]
    )
    # the family's position rule gives the reference's dense positions of the same grids
    dense = video.build_patch_positions(grid, spatial_merge_size=merge)
    assert np.array_equal(block_patch_positions(grid.numpy(), merge), dense.numpy())
    pixels = torch.randn(
        int(grid.prod(-1).sum()), 3 * patch * patch, generator=torch.Generator().manual_seed(0)
    )
    model = (
        onevision.reference_classes("llava_onevision2")[1]
        .from_pretrained(hf_folder, dtype=torch.float32)
        .eval()
    )
    visual = model.model.visual
    cases = {"windows of 4": (4, positions), "windows of 0": (0, positions), "windows of 2": (2, positions),
             "zeroed positions": (4, positions * 0)}  # fmt: skip
    theirs = {}
    with torch.no_grad():
        for name, (frames, at) in cases.items():
            visual.config.frame_windows_size = frames
            theirs[name] = visual(pixels, grid_thw=grid, patch_positions=at).last_hidden_state
    ours = _our_features(hf_folder, pixels, grid, positions)
    gaps = {name: _gap(ours, out) for name, out in theirs.items()}
    print(f"patch {patch} merge {merge}: relative gap to the reference: {gaps}")
    merged = int(grid.prod(-1).sum()) // merge**2
    assert ours.shape == theirs["windows of 4"].shape == (merged, v["out_hidden_size"])
    assert gaps.pop("windows of 4") < 1e-5
    for name, gap in gaps.items():  # controls: other windows or positions in the reference, other features
        assert gap > 1e-2, f"control {name}: the features move by only {gap:.2e} (relative)"
