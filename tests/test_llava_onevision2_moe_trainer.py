"""LLaVA-OneVision-2 MoE with expert parallelism, against the reference MoE
``LlavaOnevision2ForConditionalGeneration`` (../shared/reference/llava_onevision2, loaded in tests only).

One packed dataset for all tests: the mllm_demo records (six samples, eight images) packed into bins by
``mmpack pack --model DIR``, DIR a tiny random OneVision-2 MoE (4 experts, 2 per token, renormalised; RoPE
bases 100) built from the reference classes. The trainer's load-balancing coefficient is 0 here
(config.json's ``router_aux_loss_coef``), so that its loss is the language loss the reference computes
without ``output_router_logits``. One step of the first two bins (global batch 2) at lr 0:

- EP2 (TP1, DP2) and TP2 x EP2 on two ranks (sequence parallel, ``--expert-tensor-parallel-size 1``): the
  logged lm loss equals the reference's on the same samples one by one to 1e-5 relative; control: the
  reference with two experts of every layer swapped gives another loss;
- a checkpoint saved at EP2 (DP2) after one iteration (lr 3e-3) resumes at EP1 (DP1, the same global batch):
  its next iteration equals the uninterrupted run's;
- ``mmpack convert`` HF -> megatron-core at TP2 -> HF is bit-exact (each expert's own tensors, as the
  reference's ``save_pretrained`` writes them) and the export gives the same loss in the reference classes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import onevision
from tests.support.hf_parity import check_convert_round_trip, records_file
from tests.support.onevision import moe_args, reference_loss, swap_experts

pytestmark = [pytest.mark.ranks, pytest.mark.family, pytest.mark.shared, pytest.mark.slow]


@pytest.fixture(scope="module")
def setup(onevision2_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The session's tiny OneVision-2 MoE; the six mllm_demo records packed into bins of 640 tokens (two)
    and of 256 (four or more); the reference's loss on the two bins of 640."""
    from mmpack.cli import main as mmpack

    onevision.need_demo_records()
    hf_dir = onevision2_model("llava_onevision2_moe", **onevision.MOE_FIELDS)
    root = tmp_path_factory.mktemp("onevision2-moe")
    records = records_file(root, with_video=False)
    packed = {}
    for length in (640, 256):  # two bins: one step holds them all; more: two steps of other bins
        packed[length] = root / f"packed{length}"
        args = ["pack", "-i", str(records), "-o", str(packed[length])]
        assert mmpack([*args, "-L", str(length), "--model", str(hf_dir), "--no-progress"]) == 0
    counts = [json.loads((packed[n] / "manifest.json").read_text())["counts"] for n in (640, 256)]
    assert counts[0]["bins"] == 2 and counts[1]["bins"] >= 4, counts
    assert counts[0]["samples_packed"] == counts[1]["samples_packed"] == 6, counts
    found = {"hf": hf_dir, "packed": packed[640], "packed_small": packed[256]}
    return found | {"ref": reference_loss(hf_dir, packed[640], bins=2)}


def test_ep2_and_tp2_ep2_loss_equals_the_reference(setup: dict, tmp_path: Path) -> None:
    from tests.support.trainer import ok, train

    runs = {}
    for tp, ep in ((1, 2), (2, 2)):
        run = ok(
            train(
                2,
                moe_args(setup, tp, ep, "--train-iters", "1", "--lr", "0"),
                tmp_path / f"tp{tp}ep{ep}",
                tiny=False,
            )
        )
        runs[(tp, ep)] = run.train[0]
    ref = setup["ref"]
    swapped = reference_loss(setup["hf"], setup["packed"], bins=2, edit=swap_experts)
    print(
        f"EP2 {runs[(1, 2)]['loss']!r}, TP2xEP2 {runs[(2, 2)]['loss']!r}, reference {ref['loss']!r}, swapped experts {swapped['loss']!r}"
    )
    for step in runs.values():
        assert step["target_tokens"] == ref["tokens"]
        assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert abs(swapped["loss"] - ref["loss"]) / ref["loss"] > 1e-3


def test_ep2_checkpoint_resumed_at_ep1_continues_equal(setup: dict, tmp_path: Path) -> None:
    from tests.support.trainer import checkpoint_view, ok, train

    ckpt = tmp_path / "ckpt"
    more = ["--train-iters", "2", "--lr", "3e-3"]
    full = ok(
        train(
            2,
            moe_args(setup, 1, 2, *more, "--save", str(ckpt), "--save-interval", "1", data="packed_small"),
            tmp_path / "full",
            tiny=False,
        )
    )
    assert [m["iteration"] for m in full.train] == [1, 2]
    view = checkpoint_view(ckpt, 1, tmp_path)
    again = ok(
        train(
            1,
            moe_args(setup, 1, 1, *more, "--load", str(view), data="packed_small"),
            tmp_path / "resumed",
            tiny=False,
        )
    )
    assert f"resumed from {view} at iteration 1" in again.stdout
    print(f"full {[m['loss'] for m in full.train]}, resumed at EP1 {[m['loss'] for m in again.train]}")
    [resumed] = again.train
    assert resumed["iteration"] == 2 and resumed["data_digest"] == full.train[1]["data_digest"]
    assert resumed["loss"] == pytest.approx(full.train[1]["loss"], rel=1e-4)
    assert resumed["loss"] != pytest.approx(full.train[0]["loss"], rel=1e-4)


def test_convert_round_trip_is_bit_exact_and_the_export_loads_in_the_reference(
    setup: dict, tmp_path: Path
) -> None:
    """HF -> megatron-core at TP2 (the experts cut over 2 ranks) -> HF: each expert's own tensors, bit for bit."""
    check_convert_round_trip(setup, tmp_path, 2, 1, lambda hf, packed: reference_loss(hf, packed, bins=2))


# LoRA on the language model's attention (every decoder layer's MLP is experts, not adapted), the vision tower
# and the projector
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "self_attn.qkv", "self_attn.proj", "mlp.fc1", "mlp.fc2", "merger.mlp.0", "merger.mlp.2"]  # fmt: skip


def test_lora_at_ep2_equals_peft(setup: dict, tmp_path: Path) -> None:
    """peft's LoRA (rank 4, nonzero B) on the reference MoE, saved and read by mmpack at EP2 (DP2: a bin per
    rank): the loss before and after one Adam step and every adapter gradient equal peft's to 1e-5 (relative);
    control: another adapter init moves the loss
    (tests/support/lora_parity.py)."""
    pytest.importorskip("peft")
    from tests.support.lora_parity import check_lora_step, run_lora_step

    ref = onevision.peft_lora_reference(setup, LORA_TARGETS, tmp_path / "adapter", bins=2)
    args = moe_args(setup, 1, 2, "--train-iters", "1", "--lr", "0")
    results = run_lora_step(ref, tmp_path, 2, args)
    check_lora_step(ref, results, 1, 1, "OneVision-2 MoE EP2")
    assert results[0]["loss"] == results[1]["loss"]  # the whole global batch's on either DP rank
    assert not [n for n in results[0]["lora_params"] if ".experts." in n or ".router." in n]
