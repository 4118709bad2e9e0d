"""Pieces of the GPU path that CPU tests can check: THD padding for sequence parallelism (a dummy trailing
cu_seqlens segment), Transformer Engine's fused norm weights initialised and loaded as norms (ones, the HF
norm tensors); and, on a CUDA machine with TE, bf16 training with --fp32-residual-connection."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mmpack.packing.layout import IGNORE_INDEX
from mmpack.packing.mrope import MRopeRule
from mmpack.trainer.batches import Sample, make_micro_batch
from tests.support.trainer import train


def _batch() -> dict:
    samples = [
        Sample(
            input_ids=np.arange(1, n + 1, dtype=np.int64),
            loss_mask=np.ones(n, dtype=np.uint8),
            image_grid_thw=np.zeros((0, 3), dtype=np.int64),
            pixel_values=np.zeros((0, 1176), dtype=np.float32),
        )
        for n in (4, 3)
    ]
    rule = MRopeRule(image_pad_id=99, merge_size=2)
    return make_micro_batch([samples], seq_length=10, pad_id=0, position_rule=rule)


def test_thd_padding_adds_a_dummy_trailing_segment() -> None:
    from mmpack.trainer.data import model_inputs, pad_flat_batch

    batch = _batch()
    assert batch.cu_seqlens.tolist() == [0, 4, 7, 10]  # the row's padding is its own segment
    padded = pad_flat_batch(batch, 4, pad_id=0)
    assert padded.tokens.shape == (1, 12)
    assert padded.cu_seqlens.tolist() == [0, 4, 7, 10, 12]
    assert padded.tokens[0, 10:].tolist() == [0, 0]
    assert padded.labels[0, 10:].tolist() == [IGNORE_INDEX] * 2
    assert padded.loss_mask.sum() == batch.loss_mask.sum()
    assert padded.max_seqlen == batch.max_seqlen
    assert padded.position_ids[:, 0, 10:].tolist() == [[0, 1]] * 3  # the dummy segment: text from 0
    inputs = model_inputs(padded, use_thd=True)
    assert inputs["tokens"].shape == (1, 12) and inputs["position_ids"].shape == (3, 1, 12)
    assert inputs["packed_seq_params"].cu_seqlens_q.tolist() == [0, 4, 7, 10, 12]
    assert inputs["position_ids"][0, 0, :7].tolist() == [0, 1, 2, 3, 0, 1, 2]  # samples still restart at 0
    assert pad_flat_batch(batch, 5, pad_id=0) is batch  # 10 divides by 5: nothing to add


def test_te_fused_norm_weights_are_norms() -> None:
    from mmpack.trainer.models.hf_weights import RandomHFWeights, local_param_name, read_shard
    from mmpack.trainer.models.protocol import TinyModelSpec
    from mmpack.trainer.models.qwen2_5_vl import FAMILY, arch_from_hf_config

    arch = arch_from_hf_config(
        FAMILY.tiny_hf_config(
            TinyModelSpec(
                vocab_size=256, image_token_id=250, vision_start_token_id=251, vision_end_token_id=252
            )
        )
    )
    rules = FAMILY.hf.stage_rules(arch, 0, 1)
    te_names = {
        "language_model.decoder.layers.1.self_attention.linear_qkv.layer_norm_weight": "input_layernorm",
        "language_model.decoder.layers.1.mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm",
    }
    for te_name, hf_norm in te_names.items():
        rule = rules[local_param_name(te_name)]
        assert rule.hf == (f"model.layers.1.{hf_norm}.weight",)
        reader = RandomHFWeights(
            {rule.hf[0]: (arch.hidden_size,)}, seed=1, std=0.02, num_layers=arch.num_layers
        )
        assert torch.equal(read_shard(reader, rule, 0, 1), torch.ones(arch.hidden_size))  # type: ignore[arg-type]
    assert local_param_name("language_model.decoder.layers.1.self_attention.linear_qkv.weight").endswith(
        "linear_qkv.weight"
    )


@pytest.mark.ranks
@pytest.mark.gpu
@pytest.mark.slow
def test_bf16_with_fp32_residual_under_transformer_engine(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("transformer_engine")
    args = [
        "--mock-data",
        "--seq-length",
        "256",
        "--train-iters",
        "2",
        "--bf16",
        "--fp32-residual-connection",
    ]
    run = train(1, args, tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "THD cu_seqlens (TE)" in run.stdout
    assert len(run.losses()) == 2 and all(math.isfinite(x) for x in run.losses())


def test_segment_attention_equals_a_block_mask() -> None:
    """The vision tower's attention over cu_seqlens segments equals softmax attention under the dense
    block-diagonal mask it replaces; a control without the segments differs."""
    from mmpack.trainer.models.segment_attention import segment_attention

    gen = torch.Generator().manual_seed(0)
    lengths = [5, 16, 1, 9]
    s, heads, d = sum(lengths), 3, 8
    q, k, v = (torch.randn(s, heads, d, generator=gen) for _ in range(3))
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    block = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = block[:, None] == block[None, :]
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    reference = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)
    out = segment_attention(q, k, v, cu, scale=1 / math.sqrt(d))
    assert torch.allclose(out, reference, atol=1e-6)
    whole = segment_attention(q, k, v, torch.tensor([0, s], dtype=torch.int32), scale=1 / math.sqrt(d))
    assert not torch.allclose(whole, reference, atol=1e-3)
