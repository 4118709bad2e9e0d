"""LLaVA-OneVision-2 dense through the whole path, against the reference ``LlavaOnevision2ForConditionalGeneration``
(the modeling files LLaVA-OneVision-2 publishes, ../shared/reference/llava_onevision2, loaded in tests only).

Two packed datasets: the real mllm_demo records (six samples, eight images) packed into one bin by
``mmpack pack --model DIR``, DIR a tiny random OneVision-2 (OneVision-Encoder patch 14, merge 2, or patch 16,
merge 3; Qwen3 text, RoPE bases 100) built from the reference classes and written by ``save_pretrained``, with
a Qwen2-VL-style processor config of the same patch and merge size (temporal patch 1) and the Qwen3 tokenizer.
The reference's loss is each sample alone with the loader's pixels and grids and the reference's own
``build_patch_positions`` (sum of token cross-entropies over the loss tokens / their count).

- the loader, built with the family's position rule, hands each micro-batch the reference's patch positions
  (both geometries);
- one iteration at lr 0, TP2 x PP2 (patch 14, merge 2) and one rank (patch 16, merge 3): the logged lm loss
  equals the reference's to 1e-5 relative; controls: zeroed vision features and zeroed patch positions move
  our loss, zeroed pixels move the reference's, by far more than the tolerance;
- ``mmpack convert`` HF -> megatron-core at TP2 x PP2 -> HF is bit-exact and the export, loaded in the
  reference classes, gives the same loss.

The tiny models are the session's (``onevision2_model``); the ranks run ``tests.support.onevision``'s worker.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import onevision
from tests.support.hf_parity import check_convert_round_trip, records_file, torchrun, train_args

pytestmark = [pytest.mark.family, pytest.mark.shared, pytest.mark.slow]


def _packed_setup(root: Path, hf_dir: Path) -> dict:
    """The six mllm_demo records under ``root`` packed into one bin with ``--model hf_dir`` and the
    reference's loss."""
    from mmpack.cli import main as mmpack

    records, packed = records_file(root, with_video=False), root / "packed"
    args = ["pack", "-i", str(records), "-o", str(packed), "-L", "2048", "--model", str(hf_dir)]
    assert mmpack([*args, "--no-progress"]) == 0
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["counts"]["bins"] == 1 and manifest["counts"]["samples_packed"] == 6
    return {"root": root, "hf": hf_dir, "packed": packed, "ref": onevision.reference_loss(hf_dir, packed)}


@pytest.fixture(scope="module")
def setup(onevision2_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny model of patch 14 and merge 2."""
    onevision.need_demo_records()
    return _packed_setup(tmp_path_factory.mktemp("onevision2"), onevision2_model())


@pytest.fixture(scope="module")
def setup_patch16_merge3(
    onevision2_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict:
    """The same records for an encoder of patch 16 and merge 3 (48-pixel merged blocks), the images at their
    own size (at most 300 x 199 pixels)."""
    onevision.need_demo_records()
    hf_dir = onevision2_model(patch_size=16, merge_size=3, max_pixels=100352)
    return _packed_setup(tmp_path_factory.mktemp("onevision2-p16m3"), hf_dir)


@pytest.mark.parametrize("geometry", ["setup", "setup_patch16_merge3"])
def test_loader_hands_the_reference_patch_positions(geometry: str, request: pytest.FixtureRequest) -> None:
    """Built with the family's position rule, the loader's micro-batch holds the reference's patch positions
    of its images (block order of the model's merge size) and 1-D text positions restarting per sample on
    all three axes."""
    import numpy as np
    import torch

    from mmpack.dataloader import Topology, build_loader
    from mmpack.packing.batch import contract_problems
    from mmpack.trainer.models import family, read_hf_config

    setup = request.getfixturevalue(geometry)
    _, _, video = onevision.reference_modules()
    fam = family("llava_onevision2")
    arch = fam.arch_from_hf_config(read_hf_config(setup["hf"]))
    loader = build_loader(
        str(setup["packed"]), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=1, num_epochs=1, position_rule=fam.position_rule(arch),
    )  # fmt: skip
    batch = next(iter(loader))
    loader.close()
    assert contract_problems(batch) == []
    merge, patch = arch.vision.spatial_merge_size, arch.vision.patch_size
    assert batch.pixel_values.shape == (int(batch.image_grid_thw.prod(-1).sum()), 3 * patch * patch)
    assert (batch.image_grid_thw[:, 1:] % merge == 0).all()
    expected = video.build_patch_positions(batch.image_grid_thw, spatial_merge_size=merge)
    assert len(batch.image_grid_thw) == 8 and batch.patch_positions.dtype == torch.int64
    assert torch.equal(batch.patch_positions, expected)
    cu = batch.cu_seqlens.numpy()
    want = np.concatenate([np.arange(b - a) for a, b in itertools.pairwise(cu)])
    assert (batch.position_ids.numpy() == want[None, None]).all()


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("geometry", "tp", "pp", "positions_gap"),
    [("setup", 2, 2, 1e-3), ("setup_patch16_merge3", 1, 1, 1e-4)],
    ids=["tp2_pp2", "patch16_merge3_tp1"],
)
def test_loss_equals_the_reference_and_controls_move_it(
    geometry: str, tp: int, pp: int, positions_gap: float, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """One iteration at lr 0 (TP2 x PP2 at patch 14 / merge 2; one rank at patch 16 / merge 3); the zeroed
    patch positions must move the loss by ``positions_gap`` (relative), the other controls by 1e-3."""
    setup = request.getfixturevalue(geometry)
    args = train_args(setup["hf"], setup["packed"], tp, pp)
    torchrun(tp * pp, ["-m", "tests.support.onevision", str(tmp_path), *args], tmp_path)
    losses = json.loads((tmp_path / "losses.json").read_text())
    ref = setup["ref"]
    zeroed_ref = onevision.reference_loss(setup["hf"], setup["packed"], zero_pixels=True)["loss"]
    gaps = {
        name: abs(value - ref["loss"]) / ref["loss"]
        for name, value in (*losses.items(), ("ref zeroed pixels", zeroed_ref))
    }
    print(
        f"{geometry} TP{tp}xPP{pp}: loss {losses['loss']!r}, reference {ref['loss']!r}; relative gaps {gaps}"
    )
    assert losses["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for name in ("zeroed_vision", "zeroed_patch_positions", "ref zeroed pixels"):
        least = positions_gap if name == "zeroed_patch_positions" else 1e-3
        assert gaps[name] > least, f"control {name}: the loss moves by only {gaps[name]:.2e} (relative)"


@pytest.mark.ranks
def test_convert_round_trip_is_bit_exact_and_the_export_loads_in_the_reference(
    setup: dict, tmp_path: Path
) -> None:
    check_convert_round_trip(setup, tmp_path, 2, 2, onevision.reference_loss)


# LoRA on the language model, the vision tower and the projector (every linear module of each)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "self_attn.qkv", "self_attn.proj", "mlp.fc1", "mlp.fc2", "merger.mlp.0", "merger.mlp.2"]  # fmt: skip


@pytest.mark.ranks
def test_lora_equals_peft_at_tp2_pp2(setup: dict, tmp_path: Path) -> None:
    """peft's LoRA (rank 4, nonzero B) on the reference model, saved and read by mmpack at TP2 x PP2: the loss
    before and after one Adam step and every adapter gradient equal peft's to 1e-5 (relative); control: another
    adapter init moves the loss (tests/support/lora_parity.py)."""
    pytest.importorskip("peft")
    from tests.support.lora_parity import check_lora_step, run_lora_step

    ref = onevision.peft_lora_reference(setup, LORA_TARGETS, tmp_path / "adapter")
    results = run_lora_step(ref, tmp_path, 4, train_args(setup["hf"], setup["packed"], 2, 2))
    check_lora_step(ref, results, 2, 2, "OneVision-2 TP2xPP2")
