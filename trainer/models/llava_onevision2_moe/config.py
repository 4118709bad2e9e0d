"""The LLaVA-OneVision-2 MoE architecture (``model_type`` ``llava_onevision2_moe``): the dense family's
OneVision-Encoder and Qwen3 attention (:mod:`mmpack.trainer.models.llava_onevision2`) with a mixture of experts
as every decoder layer's MLP (:mod:`mmpack.trainer.models.qwen_moe`, ``text_config`` of ``qwen3_moe``), from a
``config.json``; its megatron-core configs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmpack.trainer.models.llava_onevision2 import config as dense
from mmpack.trainer.models.protocol import TinyModelSpec
from mmpack.trainer.models.qwen_moe import (
    MoEArch,
    as_dense_text,
    moe_language_extra,
    tiny_moe_text_fields,
    with_experts,
)
from mmpack.trainer.models.vision_common import VLMegatronConfigs

MODEL_TYPE = "llava_onevision2_moe"


@dataclass(kw_only=True, frozen=True)
class OneVision2MoeArch(dense.OneVision2Arch):
    """The dense architecture and the experts of its language layers."""

    moe: MoEArch


def arch_from_hf_config(cfg: dict[str, Any]) -> OneVision2MoeArch:
    """The architecture of a LLaVA-OneVision-2 MoE config dict (its router's top-k renormalisation as the file
    says, ``norm_topk_prob``)."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise ValueError(f"model_type is {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}")
    text = cfg.get("text_config") or {}
    if text.get("model_type", "qwen3_moe") != "qwen3_moe":
        raise ValueError(f"text_config model_type {text.get('model_type')!r} is not supported ('qwen3_moe')")
    # the dense reading of the attention, norms and vision tower (the MLP sizes are the experts'); each
    # expert's own tensors, as its save_pretrained writes them (Qwen3-MoE's checkpoint layout)
    dense_cfg, moe = as_dense_text(cfg, dense.MODEL_TYPE)
    return with_experts(OneVision2MoeArch, dense.arch_from_hf_config(dense_cfg), cfg, moe)


def tiny_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """A ``config.json`` dict of a small random LLaVA-OneVision-2 MoE (the dense one's, with 4 experts of 2
    per token unless ``spec`` says; each expert as wide as the hidden size unless ``spec.ffn_hidden_size``)."""
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
        "architectures": ["LlavaOnevision2MoeForConditionalGeneration"],
        "model_type": MODEL_TYPE,
        "router_aux_loss_coef": moe["router_aux_loss_coef"],
        "text_config": {**config["text_config"], "model_type": "qwen3_moe", "norm_topk_prob": True, **moe},
    }


def build_transformer_configs(
    arch: OneVision2MoeArch, common: dict[str, Any], language_extra: dict[str, Any]
) -> VLMegatronConfigs:
    """The dense family's megatron-core configs, the language model's with the experts' fields."""
    return dense.build_transformer_configs(arch, common, moe_language_extra(arch.moe, language_extra))
