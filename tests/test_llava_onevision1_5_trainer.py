"""LLaVA-OneVision-1.5 dense through the whole path, against the reference: NeMo-AutoModel's ``RiceTransformer``
(``components/models/llava_onevision/rice_vit.py`` of the nemo-automodel 0.7.0 wheel, its copy in
../shared/reference/rice_vit loaded by its path in tests only, tests/support/onevision1_5.py; it imports only
torch and transformers) and transformers' ``Qwen3ForCausalLM``, the image embeddings scattered into the
image-pad positions as LLaVA-OneVision-1.5 does.

One packed dataset for all tests: the real mllm_demo records (six samples, eight images) packed into one bin by
``mmpack pack --model DIR``, DIR a tiny random OneVision-1.5 (RICE-ViT patch 14, merge 2, LayerNorm eps 1e-5;
Qwen3 text, RoPE base 100) written from the reference modules' weights under the checkpoint's names, with a
Qwen2-VL-style processor config (temporal patch 1) and the Qwen3 tokenizer. The reference's loss is each
sample alone with the loader's pixels and grids (sum of token cross-entropies over the loss tokens / their
count).

- TP2 x PP2, one iteration at lr 0: the logged lm loss equals the reference's to 1e-5 relative; controls:
  zeroed vision features and zeroed patch positions move our loss, zeroed pixels and a zeroed class token move
  the reference's, by far more than the tolerance;
- ``mmpack convert`` HF -> megatron-core at TP2 x PP2 -> HF is bit-exact and the export, loaded in the
  reference, gives the same loss.

Skips without ../shared (fails under CI). The ranks of the TP2 x PP2 step run ``tests.support.onevision``'s
worker (that of OneVision-2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.hf_parity import check_convert_round_trip, records_file, torchrun, train_args
from tests.support.onevision1_5 import Reference, reference_loss, rice_and_ids, tiny_hf_model

pytestmark = [pytest.mark.ranks, pytest.mark.family, pytest.mark.shared, pytest.mark.slow]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from mmpack.cli import main as mmpack

    rice, ids = rice_and_ids()
    root = tmp_path_factory.mktemp("onevision1_5")
    hf_dir = tiny_hf_model(root / "hf", rice, ids)
    packed = root / "packed"
    args = ["pack", "-i", str(records_file(root, with_video=False)), "-o", str(packed), "-L", "2048"]
    assert mmpack([*args, "--model", str(hf_dir), "--no-progress"]) == 0
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["counts"]["bins"] == 1 and manifest["counts"]["samples_packed"] == 6
    ref = reference_loss(hf_dir, packed, rice)
    return {"root": root, "hf": hf_dir, "packed": packed, "rice": rice, "ref": ref}


def _zero_class_token(model: Reference, pixels):  # type: ignore[no-untyped-def]
    model.visual.class_embedding.data.zero_()
    model.visual.class_pos_emb.data.zero_()
    return pixels


def test_tp2_pp2_loss_equals_the_reference_and_controls_move_it(setup: dict, tmp_path: Path) -> None:
    args = train_args(setup["hf"], setup["packed"], 2, 2)
    torchrun(4, ["-m", "tests.support.onevision", str(tmp_path), *args], tmp_path)
    losses = json.loads((tmp_path / "losses.json").read_text())
    ref = setup["ref"]
    ref_controls = {
        "ref zeroed pixels": reference_loss(
            setup["hf"], setup["packed"], setup["rice"], edit=lambda m, p: p * 0
        )["loss"],
        "ref zeroed class token": reference_loss(
            setup["hf"], setup["packed"], setup["rice"], edit=_zero_class_token
        )["loss"],
    }
    print(f"TP2xPP2: loss {losses['loss']!r}, reference {ref['loss']!r}; controls {losses}, {ref_controls}")
    assert losses["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    controls = {k: losses[k] for k in ("zeroed_vision", "zeroed_patch_positions")} | ref_controls
    for name, value in controls.items():
        gap = abs(value - ref["loss"]) / ref["loss"]
        assert gap > 1e-3, f"control {name}: the loss moves by only {gap:.2e} (relative)"


def test_convert_round_trip_is_bit_exact_and_the_export_gives_the_same_loss(
    setup: dict, tmp_path: Path
) -> None:
    check_convert_round_trip(
        setup, tmp_path, 2, 2, lambda hf, packed: reference_loss(hf, packed, setup["rice"])
    )


# LoRA on the language model, the vision tower and the projector (every linear module of each)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2", "merger.mlp.0", "merger.mlp.2"]  # fmt: skip


def test_lora_equals_peft_at_tp2_pp2(setup: dict, tmp_path: Path) -> None:
    """peft's LoRA (rank 4, nonzero B) on the reference (RICE-ViT + Qwen3ForCausalLM under the checkpoint's
    names), saved and read by mmpack at TP2 x PP2: the loss before and after one Adam step and every adapter
    gradient equal peft's to 1e-5 (relative); control: another adapter init moves the loss
    (tests/support/lora_parity.py)."""
    pytest.importorskip("peft")
    from tests.support.hf_parity import loader_samples, model_inputs_of
    from tests.support.lora_parity import check_lora_step, peft_reference, run_lora_step
    from tests.support.onevision1_5 import peft_class

    inputs = model_inputs_of(loader_samples(setup["packed"], [(True, False)] * 6))
    model_class = peft_class(setup["rice"])
    ref = peft_reference(
        setup["hf"], setup["packed"], inputs, LORA_TARGETS, tmp_path / "adapter", model_class
    )
    results = run_lora_step(ref, tmp_path, 4, train_args(setup["hf"], setup["packed"], 2, 2))
    check_lora_step(ref, results, 2, 2, "OneVision-1.5 TP2xPP2")
