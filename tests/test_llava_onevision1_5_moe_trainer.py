"""LLaVA-OneVision-1.5 MoE (the RICE-ViT and a Qwen3-MoE text model, as its 30B-A3B) with expert parallelism,
against the reference: NeMo-AutoModel's ``RiceTransformer`` (see tests/support/onevision1_5.py) and
transformers' ``Qwen3MoeForCausalLM``, the image embeddings scattered into the image-pad positions.

The model folder keeps the dense ``model_type`` ``llavaonevision1_5`` with a Qwen3-MoE ``text_config`` (4
experts, 2 per token, renormalised; the trainer's load-balancing coefficient 0, so that its loss is the
language loss the reference computes) and the text model's tensors as ``Qwen3MoeForCausalLM.save_pretrained``
writes them (each expert's own). The mllm_demo records are packed into two bins by ``mmpack pack --model DIR``;
one step of both (global batch 2) at lr 0:

- the registry reads the folder as the MoE family;
- EP2 (TP1, DP2) and TP2 x EP2 on two ranks (sequence parallel, ``--expert-tensor-parallel-size 1``): the logged
  lm loss equals the reference's on the same samples one by one to 1e-5 relative; control: the reference with
  experts 0 and 1 of every layer swapped gives another loss;
- ``mmpack convert`` HF -> megatron-core at TP2 -> HF is bit-exact and the export gives the same loss in the
  reference.

Skips without ../shared (fails under CI).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.hf_parity import check_convert_round_trip, records_file
from tests.support.onevision1_5 import reference_loss, rice_and_ids, tiny_hf_model

pytestmark = [pytest.mark.family, pytest.mark.slow]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from mmpack.cli import main as mmpack

    rice, ids = rice_and_ids()
    root = tmp_path_factory.mktemp("onevision1_5-moe")
    hf_dir = tiny_hf_model(
        root / "hf", rice, ids, "llavaonevision1_5_moe", num_experts=4, moe_router_topk=2, ffn_hidden_size=48,
        moe_aux_loss_coeff=0,
    )  # fmt: skip
    packed = root / "packed"
    args = ["pack", "-i", str(records_file(root, with_video=False)), "-o", str(packed), "-L", "640"]
    assert mmpack([*args, "--model", str(hf_dir), "--no-progress"]) == 0
    counts = json.loads((packed / "manifest.json").read_text())["counts"]
    assert counts["bins"] == 2 and counts["samples_packed"] == 6, counts
    ref = reference_loss(hf_dir, packed, rice, bins=2)
    return {"hf": hf_dir, "packed": packed, "rice": rice, "ref": ref}


@pytest.mark.shared
def test_the_folder_reads_as_the_moe_family(setup: dict) -> None:
    from safetensors.torch import load_file

    from mmpack.trainer.models import family_of, read_hf_config

    config = read_hf_config(setup["hf"])
    assert config["model_type"] == "llavaonevision1_5" and config["text_config"]["model_type"] == "qwen3_moe"
    fam = family_of(config)
    arch = fam.arch_from_hf_config(config)
    assert fam.model_type == "llavaonevision1_5_moe" and arch.moe.num_experts == 4 and arch.moe.top_k == 2
    names = load_file(str(setup["hf"] / "model.safetensors"))
    assert (
        "model.layers.0.mlp.experts.3.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    )
    # the same text model_type without experts: the dense family; experts under the dense text model_type: MoE
    text = {k: v for k, v in config["text_config"].items() if k != "num_experts"}
    assert (
        family_of({**config, "text_config": {**text, "model_type": "qwen3"}}).model_type
        == "llavaonevision1_5"
    )
    text = {**config["text_config"], "model_type": "LLaVAOneVision1_5_text"}
    assert family_of({**config, "text_config": text}).model_type == "llavaonevision1_5_moe"


def _swap_experts(model, pixels):  # type: ignore[no-untyped-def]
    """Experts 0 and 1 of every layer change places (router rows unchanged); the pixels as they are."""
    import torch

    with torch.no_grad():
        for layer in model.text.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                p[[0, 1]] = p[[1, 0]].clone()
    return pixels


@pytest.mark.shared
@pytest.mark.ranks
def test_ep2_and_tp2_ep2_loss_equals_the_reference(setup: dict, tmp_path: Path) -> None:
    from tests.support.trainer import ok, train

    runs = {}
    for tp, ep in ((1, 2), (2, 2)):
        args = [
            "--hf-model", str(setup["hf"]), "--data-path", str(setup["packed"]),
            "--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(ep),
            "--expert-tensor-parallel-size", "1", *(["--sequence-parallel"] if tp > 1 else []),
            "--micro-batch-size", "1", "--global-batch-size", "2", "--log-interval", "1", "--num-workers", "0",
            "--seed", "5", "--train-iters", "1", "--lr", "0",
        ]  # fmt: skip
        runs[(tp, ep)] = ok(train(2, args, tmp_path / f"tp{tp}ep{ep}", tiny=False)).train[0]
    ref = setup["ref"]
    swapped = reference_loss(setup["hf"], setup["packed"], setup["rice"], bins=2, edit=_swap_experts)
    print(
        f"EP2 {runs[(1, 2)]['loss']!r}, TP2xEP2 {runs[(2, 2)]['loss']!r}, reference {ref['loss']!r}, "
        f"swapped experts {swapped['loss']!r}"
    )
    for step in runs.values():
        assert step["target_tokens"] == ref["tokens"]
        assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert abs(swapped["loss"] - ref["loss"]) / ref["loss"] > 1e-3


@pytest.mark.shared
@pytest.mark.ranks
def test_convert_round_trip_is_bit_exact_and_the_export_gives_the_same_loss(
    setup: dict, tmp_path: Path
) -> None:
    """HF -> megatron-core at TP2 (the experts cut over 2 ranks) -> HF: each expert's own tensors, bit for bit."""
    check_convert_round_trip(
        setup, tmp_path, 2, 1, lambda hf, packed: reference_loss(hf, packed, setup["rice"], bins=2)
    )


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("model_type", "nproc", "more"),
    [
        ("llavaonevision1_5_moe", 2, ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]),
        ("llava_onevision2", 1, []),
    ],
)  # fmt: skip
def test_mock_data_trains_the_temporal_patch_1_families(
    model_type: str, nproc: int, more: list[str], tmp_path: Path
) -> None:
    """``--model-type`` with ``--mock-data`` (no ../shared needed): the synthetic pixels come in the model's
    patch width (temporal patch 1 here, 2 for the Qwen families), and the random MoE OneVision-1.5 (its
    config keeps the dense ``model_type``) trains at EP2 with its routers' load-balancing loss logged."""
    from tests.support.trainer import ok, train

    args = [
        "--model-type", model_type, "--mock-data", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--num-workers", "0", "--train-iters", "2", "--micro-batch-size", "1",
        "--global-batch-size", str(nproc), "--seq-length", "256", "--log-interval", "1", *more,
    ]  # fmt: skip
    run = ok(train(nproc, args, tmp_path, tiny=False))
    assert [m["iteration"] for m in run.train] == [1, 2]
    assert all(m["loss"] > 0 for m in run.train)
    if more:
        assert all(m["moe_load_balancing_loss"] > 0 for m in run.train), run.train


# LoRA on the language model's attention (every decoder layer's MLP is experts, not adapted), the vision tower
# and the projector
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2", "merger.mlp.0", "merger.mlp.2"]  # fmt: skip


@pytest.mark.shared
@pytest.mark.ranks
def test_lora_at_ep2_equals_peft(setup: dict, tmp_path: Path) -> None:
    """peft's LoRA (rank 4, nonzero B) on the reference (RICE-ViT + Qwen3MoeForCausalLM under the checkpoint's
    names), saved and read by mmpack at EP2 (DP2: a bin per rank): the loss before and after one Adam step and
    every adapter gradient equal peft's to 1e-5 (relative); control: another adapter init moves the loss
    (tests/support/lora_parity.py)."""
    pytest.importorskip("peft")
    from tests.support.hf_parity import loader_samples, model_inputs_of
    from tests.support.lora_parity import check_lora_step, peft_reference, run_lora_step
    from tests.support.onevision1_5 import peft_class

    inputs = model_inputs_of(loader_samples(setup["packed"], [(True, False)] * 6, bins=2))
    model_class = peft_class(setup["rice"])
    ref = peft_reference(
        setup["hf"], setup["packed"], inputs, LORA_TARGETS, tmp_path / "adapter", model_class
    )
    args = [
        "--hf-model", str(setup["hf"]), "--data-path", str(setup["packed"]), "--expert-model-parallel-size", "2",
        "--expert-tensor-parallel-size", "1", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--log-interval", "1", "--num-workers", "0", "--seed", "5", "--train-iters", "1", "--lr", "0",
    ]  # fmt: skip
    results = run_lora_step(ref, tmp_path, 2, args)
    check_lora_step(ref, results, 1, 1, "OneVision-1.5 MoE EP2")
    assert results[0]["loss"] == results[1]["loss"]  # the whole global batch's on either DP rank
    assert not [n for n in results[0]["lora_params"] if ".experts." in n or ".router." in n]
