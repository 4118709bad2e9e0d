"""The Gemma 4 vision tower and projector (trainer/models/gemma4/vision.py) against transformers'
`Gemma4ForConditionalGeneration` on a tiny random model (tests/support/gemma4.py `vision_model_folder`: grouped
KV heads, every vision tensor random).

The three demo JPEGs go through the packer's Gemma 4 rule and the loader's patch layout (`image_to_patches`) on
our side and through transformers' `Gemma4ImageProcessorPil` on the reference side; our weights come from the
saved folder through `vision_rules`. Our soft tokens equal `get_image_features` (tower + `embed_vision`) at TP1
and at TP2; controls: the patch positions with x and y swapped, and one attention segment over all images, move
them. `vision_shapes` is the saved file's table of vision and projector tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import gemma4, ranks
from tests.support.shared import MLLM_DEMO_JSON, need_shared

pytestmark = [pytest.mark.family, pytest.mark.shared]

DEMO_IMAGES = MLLM_DEMO_JSON.parent / "mllm_demo_data"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny folder, transformers' model, the demo images' loader inputs and transformers' soft tokens."""
    need_shared(DEMO_IMAGES, gemma4.GEMMA4_TOKENIZER_DIR, what="the demo images and the Gemma 4 stand-in")
    paths = sorted(DEMO_IMAGES.glob("*.jpg"))
    folder, model = gemma4.vision_model_folder(tmp_path_factory.mktemp("gemma4_vision"))
    pixel_values, grids = gemma4.loader_image_inputs(folder, paths)
    reference = gemma4.reference_image_features(model, folder, paths)
    return {
        "folder": folder,
        "model": model,
        "pixel_values": pixel_values,
        "grids": grids,
        "reference": reference,
    }


def _gap(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest difference relative to the largest reference value."""
    return float((ours - theirs).abs().max() / theirs.abs().max())


def _arch(folder: Path) -> Any:
    from mmpack.trainer.models.gemma4.config import arch_from_hf_config

    return arch_from_hf_config(json.loads((folder / "config.json").read_text()))


@contextmanager
def _tp1_tower(tiny: dict[str, Any]) -> Iterator[Any]:
    """Our tower at TP1 in this process (a one-rank gloo group for the time of the block)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.export_check import one_rank_group

    cpu_backend.activate()  # the test is the entry point: it sets up the CPU backend (no CUDA)
    with one_rank_group():
        ps.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield gemma4.load_vision_tower(tiny["folder"], tp_rank=0, tp_size=1)


def _soft_and_grad(tower: Any, tiny: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The soft tokens and the gradient of layer 0's query-norm weight (of their summed squares)."""
    tower.zero_grad()
    soft = tower(tiny["pixel_values"], tiny["grids"])
    soft.pow(2).sum().backward()
    grad = tower.layers[0].self_attention.q_norm.weight.grad
    assert grad is not None
    return soft.detach(), grad.clone()


def test_images_of_two_sizes_in_one_call(tiny: dict[str, Any]) -> None:
    grids = tiny["grids"].tolist()
    assert len(grids) == 3 and len({tuple(g) for g in grids}) == 2, grids
    assert tiny["reference"].shape == (tiny["pixel_values"].shape[0] // 9, 32)


def test_soft_tokens_equal_transformers_at_tp1(tiny: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from mmpack.trainer.models.gemma4 import vision

    positions, attention = vision.patch_hw_positions, vision.segment_attention

    def across(q: Any, k: Any, v: Any, cu: torch.Tensor, *, scale: float) -> Any:
        return attention(q, k, v, cu[[0, -1]], scale=scale)

    with _tp1_tower(tiny) as tower, torch.no_grad():
        gap = _gap(tower(tiny["pixel_values"], tiny["grids"]), tiny["reference"])
        # control 1: each patch's (row, column) swapped, so that x and y trade places
        monkeypatch.setattr(vision, "patch_hw_positions", lambda g, k: positions(g, k)[:, ::-1].copy())
        swapped = _gap(tower(tiny["pixel_values"], tiny["grids"]), tiny["reference"])
        monkeypatch.setattr(vision, "patch_hw_positions", positions)
        # control 2: one attention segment over every image
        monkeypatch.setattr(vision, "segment_attention", across)
        one_segment = _gap(tower(tiny["pixel_values"], tiny["grids"]), tiny["reference"])
    print(
        f"relative gap at TP1 {gap:.2e}; controls: x/y swapped {swapped:.2e}, one segment {one_segment:.2e}"
    )
    assert gap < 1e-5
    assert swapped > 1e-2 and one_segment > 1e-2


@pytest.mark.ranks
@pytest.mark.slow
def test_soft_tokens_equal_transformers_at_tp2(tiny: dict[str, Any], tmp_path: Path) -> None:
    """Both TP ranks give transformers' soft tokens; the query-norm weight's gradient (its heads split over the
    ranks) is the TP1 one on each; the TP2 checkpoint shards, loaded at TP1 into a zeroed tower, give the soft
    tokens again (the gated MLP's gate and up rows are resharded apart)."""
    from megatron.core import dist_checkpointing

    inputs = tmp_path / "inputs.pt"
    torch.save({"pixel_values": tiny["pixel_values"], "image_grid_thw": tiny["grids"]}, inputs)
    argv = ["-m", "tests.support.gemma4", str(tiny["folder"]), str(inputs), str(tmp_path)]
    ranks.checked(ranks.launch(2, argv, tmp_path / "logs", timeout_s=240))
    with _tp1_tower(tiny) as tower:
        _, tp1_grad = _soft_and_grad(tower, tiny)
        with torch.no_grad():
            for param in tower.parameters():
                param.zero_()
        state = dist_checkpointing.load(
            tower.sharded_state_dict(prefix="vision."), str(tmp_path / "checkpoint")
        )
        tower.load_state_dict({k.removeprefix("vision."): v for k, v in state.items()})
        with torch.no_grad():
            resharded = _gap(tower(tiny["pixel_values"], tiny["grids"]), tiny["reference"])
    print(f"TP2 checkpoint loaded at TP1: relative gap {resharded:.2e}")
    assert resharded < 1e-5
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        gap, grad_gap = _gap(out["soft"], tiny["reference"]), _gap(out["q_norm_grad"], tp1_grad)
        print(f"TP2 rank {rank}: relative gap {gap:.2e}, q_norm gradient gap to TP1 {grad_gap:.2e}")
        assert gap < 1e-5 and grad_gap < 1e-5


def test_vision_shapes_are_the_saved_tensors(tiny: dict[str, Any]) -> None:
    """`vision_shapes` lists every vision and projector tensor of the saved file with its shape, and the rules
    read exactly those; control: the tiny config's own KV head count gives other shapes."""
    from safetensors import safe_open

    from mmpack.trainer.models.gemma4.vision import vision_rules, vision_shapes

    with safe_open(str(tiny["folder"] / "model.safetensors"), framework="pt") as f:
        saved = {
            k: tuple(f.get_slice(k).get_shape())
            for k in f.keys()  # noqa: SIM118 (safe_open handles are not dicts)
            if k.startswith(("model.vision_tower.", "model.embed_vision."))
        }
    arch = _arch(tiny["folder"])
    assert vision_shapes(arch) == saved
    assert {name for rule in vision_rules(arch).values() for name in rule.hf} == set(saved)
    config = json.loads((tiny["folder"] / "config.json").read_text())
    config["vision_config"]["num_key_value_heads"] = config["vision_config"]["num_attention_heads"]
    from mmpack.trainer.models.gemma4.config import arch_from_hf_config

    assert vision_shapes(arch_from_hf_config(config)) != saved
