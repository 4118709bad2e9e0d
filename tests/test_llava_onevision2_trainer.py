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

This file is also the torchrun worker of those steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, SHARED_DIR

pytestmark = pytest.mark.slow

REFERENCE_DIR = SHARED_DIR / "reference"
VOCAB = 151936
MERGE = 2


def image_config(patch_size: int = 14, merge_size: int = MERGE, max_pixels: int = 50176) -> dict[str, Any]:
    """A Qwen2-VL-style processor config (temporal patch 1) of that patch and merge size."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": patch_size,
        "temporal_patch_size": 1,
        "merge_size": merge_size,
        "min_pixels": 3136,
        "max_pixels": max_pixels,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }


IMAGE_CONFIG = image_config()


def _worker(out_dir: str, argv: list[str]) -> None:
    """One step's loss, then the loss under the controls (zeroed vision features, zeroed patch positions)."""
    import torch
    import torch.distributed as dist

    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.training import Trainer, shutdown
    from tests.test_qwen3_vl_trainer import _loss

    trainer = Trainer(parse_args(argv))
    batches, _ = trainer.train_data.next_step()
    loss = _loss(trainer._run_schedule(batches, forward_only=True))
    with torch.no_grad():
        flat = [
            b if b.patch_positions is None else dataclasses.replace(b, patch_positions=b.patch_positions * 0)
            for b in batches
        ]
        flat_positions = _loss(trainer._run_schedule(flat, forward_only=True))
        stage = trainer.model.module
        if stage.vision is not None:
            stage.vision.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
        zeroed = _loss(trainer._run_schedule(batches, forward_only=True))
    if trainer.is_logger:
        result = {"loss": loss, "zeroed_vision": zeroed, "zeroed_patch_positions": flat_positions}
        (Path(out_dir) / "losses.json").write_text(json.dumps(result))
    dist.barrier()
    trainer.close()
    shutdown()


# -- the test side ----------------------------------------------------------------------------------------


def _reference_modules():  # type: ignore[no-untyped-def]
    """The reference's configuration, modeling and video-processing modules, loaded from their folder."""
    if str(REFERENCE_DIR) not in sys.path:
        sys.path.insert(0, str(REFERENCE_DIR))
    from llava_onevision2 import configuration_llava_onevision2 as conf
    from llava_onevision2 import modeling_llava_onevision2 as modeling
    from llava_onevision2 import video_processing_llava_onevision2 as video

    return conf, modeling, video


def tiny_hf_model(
    folder: Path, ids: dict[str, int], model_type: str = "llava_onevision2", *, patch_size: int = 14,
    merge_size: int = MERGE, max_pixels: int = 50176, **spec_fields: int,
) -> Path:  # fmt: skip
    """A random OneVision-2 (``model_type``: dense or MoE; its encoder's ``patch_size`` and
    ``merge_size``) built from the reference classes (config from the family's tiny config), with weights
    wide enough that every part matters, the processor config of that geometry (images up to
    ``max_pixels``) and the tokenizer."""
    import torch

    from mmpack.trainer.models import family
    from mmpack.trainer.models.protocol import TinyModelSpec

    conf, modeling = _reference_classes(model_type)
    spec = TinyModelSpec(
        vocab_size=VOCAB, image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], num_layers=4, vision_depth=2, vision_num_heads=2,
        vision_hidden_size=64, patch_size=patch_size, merge_size=merge_size, **spec_fields,
    )  # fmt: skip
    config = family(model_type).tiny_hf_config(spec)
    assert config["video_token_id"] == ids["<|video_pad|>"]
    # small bases, so that every rotary frequency turns within a sample and an image
    config["text_config"]["rope_parameters"]["rope_theta"] = 100.0
    config["vision_config"]["rope_theta"] = 100.0
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = modeling(conf(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif "embed_tokens" in name or "lm_head" in name:
                param.normal_(0.0, 0.3)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(image_config(patch_size, merge_size, max_pixels))
    )
    shutil.copy(QWEN3_TOKENIZER, folder / "tokenizer.json")
    return folder


def _reference_classes(model_type: str):  # type: ignore[no-untyped-def]
    """(config class, model class) of the reference's dense or MoE variant."""
    _reference_modules()
    if model_type == "llava_onevision2":
        from llava_onevision2 import configuration_llava_onevision2 as conf
        from llava_onevision2 import modeling_llava_onevision2 as modeling

        return conf.LlavaOnevision2Config, modeling.LlavaOnevision2ForConditionalGeneration
    from llava_onevision2 import configuration_llava_onevision2_moe as conf_moe
    from llava_onevision2 import modeling_llava_onevision2_moe as modeling_moe

    return conf_moe.LlavaOnevision2MoeConfig, modeling_moe.LlavaOnevision2ForConditionalGeneration


def _samples(packed: Path, bins: int = 1) -> list[dict]:
    """Each sample of bin 0 as the loader gives it, with its slice of the image inputs."""
    from tests.test_trainer_video_parity import _samples as loader_samples

    return loader_samples(packed, [(True, False)] * 6, bins=bins)


def reference_loss(
    hf_dir: Path, packed: Path, *, zero_pixels: bool = False, bins: int = 1, edit: Any = None
) -> dict:
    """The reference's loss over the samples of the first ``bins`` bins one by one (its own patch positions
    of each sample's grids); ``edit``: a function applied to the loaded model first (controls)."""
    import torch
    import torch.nn.functional as F

    _, _, video = _reference_modules()
    config = json.loads((hf_dir / "config.json").read_text())
    merge = config["vision_config"]["spatial_merge_size"]
    model = _reference_classes(config["model_type"])[1].from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    if edit is not None:
        edit(model)
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for s in _samples(packed, bins):
            pixels, grids = s["image"]
            logits = model(
                input_ids=s["tokens"][None], pixel_values=torch.zeros_like(pixels) if zero_pixels else pixels,
                image_grid_thw=grids, patch_positions=video.build_patch_positions(grids, spatial_merge_size=merge),
            ).logits[0]  # fmt: skip
            keep = s["labels"] != -100
            total += F.cross_entropy(logits[keep].float(), s["labels"][keep], reduction="sum").double()
            count += int(keep.sum())
    return {"loss": float(total / count), "tokens": count}


def model_and_records(root: Path, model_type: str, **spec_fields: int) -> tuple[Path, Path]:
    """(tiny model folder, records file of the six mllm_demo records) under ``root``; skips without the
    shared files."""
    from tests.test_qwen3_vl_trainer import records_file

    if not (
        QWEN3_TOKENIZER.is_file()
        and MLLM_DEMO_JSON.is_file()
        and (REFERENCE_DIR / "llava_onevision2").is_dir()
    ):
        pytest.skip("needs ../shared (Qwen3 tokenizer, mllm_demo, reference/llava_onevision2)")
    ids = {t["content"]: t["id"] for t in json.loads(QWEN3_TOKENIZER.read_text())["added_tokens"]}
    return tiny_hf_model(root / "hf", ids, model_type, **spec_fields), records_file(root, with_video=False)


def _packed_setup(root: Path, **geometry: int) -> dict:
    """The tiny model (``geometry``: its patch and merge size) under ``root``, the six records packed into
    one bin with ``--model`` and the reference's loss."""
    from mmpack.offline_packing.cli import main as mmpack

    hf_dir, records = model_and_records(root, "llava_onevision2", **geometry)
    packed = root / "packed"
    args = ["pack", "-i", str(records), "-o", str(packed), "-L", "2048", "--model", str(hf_dir)]
    assert mmpack([*args, "--no-progress"]) == 0
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["counts"]["bins"] == 1 and manifest["counts"]["samples_packed"] == 6
    return {"root": root, "hf": hf_dir, "packed": packed, "ref": reference_loss(hf_dir, packed)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _packed_setup(tmp_path_factory.mktemp("onevision2"))


@pytest.fixture(scope="module")
def setup_patch16_merge3(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same records for an encoder of patch 16 and merge 3 (48-pixel merged blocks), the images at their
    own size (at most 300 x 199 pixels)."""
    root = tmp_path_factory.mktemp("onevision2-p16m3")
    return _packed_setup(root, patch_size=16, merge_size=3, max_pixels=100352)


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
    _, _, video = _reference_modules()
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
    from tests.test_trainer_hf_parity import _torchrun, _train_args

    setup = request.getfixturevalue(geometry)
    args = _train_args(setup["hf"], setup["packed"], tp, pp)
    _torchrun(tp * pp, [str(Path(__file__).resolve()), str(tmp_path), *args], tmp_path)
    losses = json.loads((tmp_path / "losses.json").read_text())
    ref = setup["ref"]
    zeroed_ref = reference_loss(setup["hf"], setup["packed"], zero_pixels=True)["loss"]
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


def test_convert_round_trip_is_bit_exact_and_the_export_loads_in_the_reference(
    setup: dict, tmp_path: Path
) -> None:
    from tests.test_qwen3_vl_trainer import check_convert_round_trip

    check_convert_round_trip(setup, tmp_path, 2, 2, reference_loss)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
