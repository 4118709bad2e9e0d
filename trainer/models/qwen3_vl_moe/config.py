"""The Qwen3-VL-MoE architecture (transformers' ``Qwen3VLMoeForConditionalGeneration``): Qwen3-VL's vision
tower and language model (:mod:`mmpack.trainer.models.qwen3_vl`) with a mixture of experts as every decoder
layer's MLP (:mod:`mmpack.trainer.models.qwen_moe`), from a ``config.json``; its megatron-core configs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmpack.trainer.models.protocol import TinyModelSpec
from mmpack.trainer.models.qwen3_vl import config as dense
from mmpack.trainer.models.qwen_moe import (
    MoEArch,
    moe_arch_from_text,
    moe_language_extra,
    tiny_moe_text_fields,
    with_experts,
)
from mmpack.trainer.models.vision_common import VLMegatronConfigs

MODEL_TYPE = "qwen3_vl_moe"


@dataclass(kw_only=True, frozen=True)
class Qwen3VLMoeArch(dense.Qwen3VLArch):
    """Qwen3-VL's architecture and the experts of its language layers."""

    moe: MoEArch


def arch_from_hf_config(cfg: dict[str, Any]) -> Qwen3VLMoeArch:
    """The architecture of a ``Qwen3VLMoeForConditionalGeneration`` config dict (its router always
    renormalises the top-k probabilities)."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise ValueError(f"model_type is {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}")
    base = dense.arch_from_hf_config({**cfg, "model_type": dense.MODEL_TYPE})
    moe = moe_arch_from_text(cfg.get("text_config") or {}, norm_topk_prob=True)
    return with_experts(Qwen3VLMoeArch, base, cfg, moe)


def tiny_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """A ``config.json`` dict of a small random Qwen3-VL-MoE (Qwen3-VL's, with 4 experts of 2 per token
    unless ``spec`` says; each expert as wide as the hidden size unless ``spec.ffn_hidden_size``)."""
    config = dense.tiny_hf_config(spec)
    moe = tiny_moe_text_fields(
        spec.num_experts,
        spec.moe_router_topk,
        spec.moe_aux_loss_coeff,
        spec.hidden_size,
        spec.ffn_hidden_size,
    )
    return {
        **config,
        "architectures": ["Qwen3VLMoeForConditionalGeneration"],
        "model_type": MODEL_TYPE,
        "text_config": {**config["text_config"], "model_type": "qwen3_vl_moe_text", **moe},
        "vision_config": {**config["vision_config"], "model_type": "qwen3_vl_moe_vision"},
    }


def build_transformer_configs(
    arch: Qwen3VLMoeArch, common: dict[str, Any], language_extra: dict[str, Any]
) -> VLMegatronConfigs:
    """Qwen3-VL's megatron-core configs, the language model's with the experts' fields."""
    return dense.build_transformer_configs(arch, common, moe_language_extra(arch.moe, language_extra))
