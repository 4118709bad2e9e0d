"""HF <-> megatron-core weight rules of Qwen2.5-VL, without processes: TP shards read from a safetensors file
merge back to the file's tensors; the fused QKV puts each query group's heads before its key and value head;
random HF-layout weights give the same model under every TP size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mmpack.trainer.models.hf_weights import (
    RandomHFWeights,
    hf_shapes,
    merge_tp_shards,
    open_hf_weights,
    read_shard,
)
from mmpack.trainer.models.protocol import TinyModelSpec
from mmpack.trainer.models.qwen2_5_vl import FAMILY, arch_from_hf_config

stage_rules = FAMILY.hf.stage_rules


def _arch(**kw):
    cfg = FAMILY.tiny_hf_config(TinyModelSpec(vocab_size=256, image_token_id=250, vision_start_token_id=251,
                                              vision_end_token_id=252, num_layers=4, num_attention_heads=4,
                                              num_key_value_heads=2, **kw))  # fmt: skip
    return arch_from_hf_config(cfg)


def _hf_tensors(arch) -> dict[str, torch.Tensor]:
    """Random HF tensors of layer 0 (q/k/v with biases, gate/up) and vision block 0's fused qkv."""
    gen = torch.Generator().manual_seed(0)
    h, d, v = arch.hidden_size, arch.head_dim, arch.vision.hidden_size
    rows = {
        "q": arch.num_attention_heads * d,
        "k": arch.num_key_value_heads * d,
        "v": arch.num_key_value_heads * d,
    }
    out = {}
    for p, n in rows.items():
        out[f"model.layers.0.self_attn.{p}_proj.weight"] = torch.randn(n, h, generator=gen)
        out[f"model.layers.0.self_attn.{p}_proj.bias"] = torch.randn(n, generator=gen)
    for p in ("gate", "up"):
        out[f"model.layers.0.mlp.{p}_proj.weight"] = torch.randn(arch.intermediate_size, h, generator=gen)
    out["visual.blocks.0.attn.qkv.weight"] = torch.randn(3 * v, v, generator=gen)
    out["visual.blocks.0.attn.qkv.bias"] = torch.randn(3 * v, generator=gen)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_shards_merge_back_to_the_file(tmp_path: Path, tp: int) -> None:
    arch = _arch()
    tensors = _hf_tensors(arch)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    rules = stage_rules(arch, 0, 1)
    wanted = [n for n, r in rules.items() if set(r.hf) <= set(tensors)]
    assert any(rules[n].kind == "qkv" for n in wanted) and any(rules[n].kind == "glu" for n in wanted)
    assert any(rules[n].kind == "fused_qkv" for n in wanted)
    with open_hf_weights(tmp_path) as reader:
        for name in wanted:
            shards = [read_shard(reader, rules[name], r, tp) for r in range(tp)]
            for hf_name, merged in merge_tp_shards(rules[name], shards).items():
                assert merged.equal(tensors[hf_name]), (name, hf_name)


def test_fused_qkv_layout_per_query_group(tmp_path: Path) -> None:
    arch = _arch()
    tensors = _hf_tensors(arch)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    rule = stage_rules(arch, 0, 1)["language_model.decoder.layers.0.self_attention.linear_qkv.weight"]
    d = arch.head_dim
    with open_hf_weights(tmp_path) as reader:
        shard = read_shard(reader, rule, 1, 2)  # TP rank 1 of 2: query group 1 of 2
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    k = tensors["model.layers.0.self_attn.k_proj.weight"]
    v = tensors["model.layers.0.self_attn.v_proj.weight"]
    assert shard.equal(torch.cat([q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]]))  # heads 2, 3; kv head 1


def test_random_weights_are_layout_independent() -> None:
    arch = _arch()
    rule = stage_rules(arch, 0, 1)["language_model.decoder.layers.1.mlp.linear_fc1.weight"]
    shard_shape = {
        1: (2 * arch.intermediate_size, arch.hidden_size),
        2: (arch.intermediate_size, arch.hidden_size),
    }
    merged, first_shard = {}, {}
    for tp in (1, 2):
        reader = RandomHFWeights(hf_shapes(rule, shard_shape[tp], tp), 5, 0.02, 4)
        shards = [read_shard(reader, rule, r, tp) for r in range(tp)]
        merged[tp], first_shard[tp] = merge_tp_shards(rule, shards), shards[0]
    # control: a plain chunk of the TP1 tensor is not the TP2 shard (gate and up rows interleave per rank)
    assert not first_shard[2].equal(first_shard[1].chunk(2)[0])
    assert merged[1].keys() == merged[2].keys()
    assert all(merged[1][k].equal(merged[2][k]) for k in merged[1])
