"""Qwen3-VL-MoE without processes: expert slices of the HF tensors (both file layouts, expert TP and its
inverse), the flags that must agree with config.json, the dispatcher refused on CPU, MoE in the FLOP count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmpack.packing.cost import LanguageFlopShape, ModelFlopShape, forward_flop_model
from mmpack.trainer.models import family
from mmpack.trainer.models.hf_weights import Rule, merge_tp_shards, open_hf_weights, read_shard
from mmpack.trainer.models.protocol import TinyModelSpec
from mmpack.trainer.models.qwen_moe import MoEArch, moe_config_fields, moe_rules

FAMILY = family("qwen3_vl_moe")
SPEC = TinyModelSpec(vocab_size=512, image_token_id=500, vision_start_token_id=502, vision_end_token_id=503)
H, FFN, E = 8, 6, 4


def _files(root: Path, transposed: bool) -> Path:
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(E, 2 * FFN, H, generator=gen), torch.randn(E, H, FFN, generator=gen)
    if transposed:  # Qwen's own files: [E, H, 2I] and [E, FFN, H]
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    root.mkdir()
    save_file(
        {"m.experts.gate_up_proj": gate_up, "m.experts.down_proj": down}, str(root / "model.safetensors")
    )
    return root


@pytest.mark.parametrize("transposed", [False, True])
def test_expert_slices_read_either_layout_and_merge_back(tmp_path: Path, transposed: bool) -> None:
    rules = moe_rules(MoEArch(num_experts=E, top_k=2, ffn_hidden_size=FFN), H, "m.", "mlp.")
    fc1, fc2 = (
        rules["mlp.experts.local_experts.2.linear_fc1.weight"],
        rules["mlp.experts.local_experts.2.linear_fc2.weight"],
    )
    with open_hf_weights(_files(tmp_path / "plain", False)) as plain:
        gate_up, down = plain.read("m.experts.gate_up_proj")[2], plain.read("m.experts.down_proj")[2]
    with open_hf_weights(_files(tmp_path / "file", transposed)) as reader:
        shards = [read_shard(reader, fc1, r, 2) for r in range(2)]
        down_shards = [read_shard(reader, fc2, r, 2) for r in range(2)]
    # expert-TP rank 0 holds its gate rows, then its up rows (megatron-core's SwiGLU layout)
    assert torch.equal(shards[0], torch.cat([gate_up[: FFN // 2], gate_up[FFN : FFN + FFN // 2]]))
    assert torch.equal(down_shards[1], down[:, FFN // 2 :])
    assert torch.equal(merge_tp_shards(fc1, shards)["m.experts.gate_up_proj"], gate_up)
    assert torch.equal(merge_tp_shards(fc2, down_shards)["m.experts.down_proj"], down)
    wrong = Rule("fused_glu", fc1.hf, expert=1, experts=E, rows=2 * FFN)  # control: another expert's rows
    with open_hf_weights(tmp_path / "file") as reader:
        assert not torch.equal(read_shard(reader, wrong, 0, 1), gate_up)


def test_flags_must_agree_with_the_config_and_experts_need_a_moe_family() -> None:
    from mmpack.trainer.build import check_size_flags
    from mmpack.trainer.config import ModelConfig

    config = FAMILY.tiny_hf_config(SPEC)
    assert config["text_config"]["num_experts"] == 4 and config["text_config"]["num_experts_per_tok"] == 2
    check_size_flags(ModelConfig(size_flags=(("num_experts", 4, "--num-experts"),)), config, "the folder")
    with pytest.raises(ValueError, match="--num-experts contradicts the folder: num_experts 8 here, 4 there"):
        check_size_flags(ModelConfig(size_flags=(("num_experts", 8, "--num-experts"),)), config, "the folder")
    with pytest.raises(ValueError, match="--moe-aux-loss-coeff contradicts"):
        check_size_flags(
            ModelConfig(size_flags=(("moe_aux_loss_coeff", 0.5, "--moe-aux-loss-coeff"),)), config, "x"
        )
    dense = family("qwen3_vl").tiny_hf_config(SPEC)
    with pytest.raises(ValueError, match="num_experts 4 here, 0 there"):
        check_size_flags(ModelConfig(size_flags=(("num_experts", 4, "--num-experts"),)), dense, "qwen3_vl")


def test_dispatchers_other_than_allgather_are_refused_without_cuda() -> None:
    moe = MoEArch(num_experts=4, top_k=2, ffn_hidden_size=8)
    fields = moe_config_fields(moe, "allgather")
    assert fields["moe_router_pre_softmax"] is False  # top-k then softmax: transformers' renormalised top-k
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--moe-token-dispatcher-type alltoall needs CUDA"):
            moe_config_fields(moe, "alltoall")


def test_flops_count_the_active_experts_and_the_router() -> None:
    arch = FAMILY.arch_from_hf_config(FAMILY.tiny_hf_config(SPEC))
    lang = FAMILY.flop_shape(arch).language
    assert (lang.experts_per_token, lang.num_experts, lang.ffn_hidden_size) == (2, 4, 64)
    h, q, kv, layers = lang.hidden_size, lang.attention_size, lang.kv_size, lang.num_layers
    per_token = 2.0 * layers * (h * (q + 2 * kv) + q * h + 2 * 3 * h * 64 + h * 4) + 2.0 * h * lang.vocab_size
    shape = ModelFlopShape(language=lang)
    assert forward_flop_model(shape, attention_by_sample=False).tokens == per_token
    dense = LanguageFlopShape(**{**lang.__dict__, "experts_per_token": 0, "num_experts": 0})
    assert forward_flop_model(ModelFlopShape(language=dense), attention_by_sample=False).tokens < per_token
    with pytest.raises(ValueError, match=r"experts_per_token 5 must be in 1\.\.num_experts 4"):
        LanguageFlopShape(**{**lang.__dict__, "experts_per_token": 5})
