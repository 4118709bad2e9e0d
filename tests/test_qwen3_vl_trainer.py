"""Qwen3-VL dense through the whole path, against transformers' ``Qwen3VLForConditionalGeneration``.

One packed dataset for all tests: the real mllm_demo records (8 images) and a real video (mllm_video_demo)
packed into one bin by ``mmpack pack --model DIR``, DIR a tiny random Qwen3-VL (tied embeddings, DeepStack
from two vision layers, RoPE base 100) written by transformers with Qwen3-VL's processor configs (a small video rule) and the
Qwen3 tokenizer. transformers' loss is each sample alone with the loader's pixels and grids and
``mm_token_type_ids`` (sum of token cross-entropies over the loss tokens / their count).

- the video sample's tokens are the processor's (timestamps included, tests/support/qwen3_vl_reference.py);
- the trainer with only the qwen3_vl family registered (no Qwen2.5-VL module imported) logs that loss at TP1;
- TP2 x PP2: the same loss, gradients of the word embedding, the patch embedding and a vision block equal
  transformers'; controls: zeroed image and video features, and megatron-core's contiguous-section MRoPE in
  place of the interleaved one, change the loss by far more than the tolerance;
- ``mmpack convert`` HF -> megatron-core at TP2 x PP2 -> HF is bit-exact and the export gives the same loss.

This file is also the torchrun worker of the TP2 x PP2 step and of the single-family run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support import qwen3_vl, qwen3_vl_reference
from tests.support.hf_parity import check_convert_round_trip, step_loss, torchrun, train_args
from tests.support.shared import QWEN3_TOKENIZER, VIDEO_DEMO

pytestmark = [pytest.mark.family, pytest.mark.shared, pytest.mark.slow]

GRAD_PARAMS = (
    "language_model.embedding.word_embeddings.weight",
    "vision.patch_embed.weight",
    "vision.layers.0.self_attention.linear_qkv.weight",
)


def _worker(out_dir: str, argv: list[str]) -> None:
    """One step's loss and gradients (before the optimizer), then the loss under the two controls."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.models.vlm_stage import VisionFeatures
    from mmpack.trainer.training import Trainer, shutdown

    cpu_backend.activate()  # the test is the entry point: it sets up the CPU backend (no CUDA)
    trainer = Trainer(parse_args(argv))
    batches, _ = trainer.train_data.next_step()
    trainer.model.zero_grad_buffer()
    loss = step_loss(trainer._run_schedule(batches, forward_only=False))
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    stage = trainer.model.module
    grads = {n: p.main_grad.detach().clone() for n, p in stage.named_parameters() if n in GRAD_PARAMS}
    torch.save(grads, Path(out_dir) / f"grads_tp{tp}_pp{pp}.pt")
    with torch.no_grad():
        lm = stage.language_model
        interleaved, lm.rotary_pos_emb = (
            lm.rotary_pos_emb,
            MultimodalRotaryEmbedding(stage.arch.head_dim, 1.0, rotary_base=int(stage.arch.rope_theta)),
        )
        sections = step_loss(trainer._run_schedule(batches, forward_only=True))
        lm.rotary_pos_emb = interleaved
        if stage.vision is not None:
            stage.vision.register_forward_hook(
                lambda m, a, out: VisionFeatures(
                    torch.zeros_like(out.merged), tuple(map(torch.zeros_like, out.deepstack))
                )
            )
        zeroed = step_loss(trainer._run_schedule(batches, forward_only=True))
    if trainer.is_logger:
        result = {"loss": loss, "sections_mrope": sections, "zeroed_vision": zeroed}
        (Path(out_dir) / "losses.json").write_text(json.dumps(result))
    dist.barrier()
    trainer.close()
    shutdown()


def _only_qwen3_vl(argv: list[str]) -> None:
    """The trainer with the registry holding Qwen3-VL alone; fails if any other family module is imported."""
    from mmpack.trainer import models

    models.FAMILIES.clear()
    models.FAMILIES["qwen3_vl"] = "mmpack.trainer.models.qwen3_vl"
    from mmpack.trainer.pretrain_vlm import main

    code = main(argv)
    other = sorted(m for m in sys.modules if m.startswith("mmpack.trainer.models.qwen2"))
    if other:
        raise SystemExit(f"imported without being registered: {other}")
    raise SystemExit(code)


# -- the test side ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(qwen3_vl_packed: dict[str, Path]) -> dict:
    """The session's tiny Qwen3-VL and packed demo records (one bin: six image samples, one video sample)
    and transformers' loss and gradients on them."""
    hf_dir, packed = qwen3_vl_packed["hf"], qwen3_vl_packed["packed"]
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["counts"]["bins"] == 1 and manifest["counts"]["samples_packed"] == 7
    assert manifest["video_rule"]["style"] == "qwen3_vl" and manifest["counts"]["videos"] == 1
    return {**qwen3_vl_packed, "ref": qwen3_vl.reference(hf_dir, packed)}


def _train_args(setup: dict, tp: int, pp: int) -> list[str]:
    return train_args(setup["hf"], setup["packed"], tp, pp)


def test_packed_video_tokens_are_the_processors(setup: dict) -> None:
    """The packed video sample holds the processor's expansion of its video (timestamps and frames)."""
    proc = qwen3_vl_reference.processor(QWEN3_TOKENIZER, qwen3_vl.SMALL_VIDEO_CONFIG)
    video = qwen3_vl_reference.video_inputs(proc, VIDEO_DEMO / "mllm_demo_data" / "1.mp4")
    expected = proc.tokenizer(proc.replace_video_token(video, video_idx=0))["input_ids"]
    [sample] = [s for s in qwen3_vl.samples(setup["packed"]) if "video" in s]
    tokens = sample["tokens"].tolist()
    starts = [i for i in range(len(tokens)) if tokens[i : i + len(expected)] == expected]
    assert len(starts) == 1, "the processor's video tokens are not in the packed sample"
    assert sample["video"][1].tolist() == video["video_grid_thw"].tolist()


@pytest.mark.ranks
def test_trainer_with_only_this_family_registered_logs_transformers_loss(setup: dict, tmp_path: Path) -> None:
    """TP1: the trainer imports and runs with the registry holding only qwen3_vl; its loss is transformers'."""
    metrics = tmp_path / "metrics.jsonl"
    args = [*_train_args(setup, 1, 1), "--metrics-file", str(metrics)]
    torchrun(1, [str(Path(__file__).resolve()), "--only-qwen3-vl", *args], tmp_path)
    step = json.loads(metrics.read_text().splitlines()[0])
    ref = setup["ref"]
    print(f"TP1 (qwen3_vl alone registered): logged lm loss {step['loss']!r}, transformers {ref['loss']!r}")
    assert step["target_tokens"] == ref["tokens"]
    assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5)


@pytest.mark.ranks
def test_tp2_pp2_loss_gradients_and_controls(setup: dict, tmp_path: Path) -> None:
    import torch

    from mmpack.trainer.models.hf_weights import merge_tp_shards
    from mmpack.trainer.models.qwen3_vl import FAMILY, arch_from_hf_config

    torchrun(4, [str(Path(__file__).resolve()), str(tmp_path), *_train_args(setup, 2, 2)], tmp_path)
    losses = json.loads((tmp_path / "losses.json").read_text())
    ref = setup["ref"]
    print(f"TP2xPP2: loss {losses['loss']!r}, transformers {ref['loss']!r}, controls {losses}")
    assert losses["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for control in ("sections_mrope", "zeroed_vision"):
        gap = abs(losses[control] - ref["loss"]) / ref["loss"]
        assert gap > 1e-3, f"control {control}: the loss moves by only {gap:.2e} (relative)"
    arch = arch_from_hf_config(json.loads((setup["hf"] / "config.json").read_text()))
    rules = FAMILY.hf.stage_rules(arch, 0, 2)
    shards = [torch.load(tmp_path / f"grads_tp{t}_pp0.pt") for t in range(2)]
    for name in GRAD_PARAMS:
        [(hf_name, grad)] = merge_tp_shards(rules[name], [s[name] for s in shards]).items()
        expected = ref["grads"][hf_name]
        scale = float(expected.abs().max())
        diff = float((grad - expected).abs().max())
        print(f"grad {hf_name}: max |diff| {diff:.3e}, max |grad| {scale:.3e}")
        assert scale > 0 and diff <= 1e-5 * scale, (hf_name, diff, scale)


@pytest.mark.ranks
def test_convert_round_trip_is_bit_exact_and_the_export_gives_the_same_loss(
    setup: dict, tmp_path: Path
) -> None:
    check_convert_round_trip(setup, tmp_path, 2, 2, qwen3_vl.reference)


if __name__ == "__main__":
    if sys.argv[1] == "--only-qwen3-vl":
        _only_qwen3_vl(sys.argv[2:])
    else:
        _worker(sys.argv[1], sys.argv[2:])
