"""The LLaVA-OneVision-1.5 MoE architecture: the dense family's RICE-ViT and Qwen3 attention
(:mod:`mmpack.trainer.models.llava_onevision1_5`) with a mixture of experts as every decoder layer's MLP
(:mod:`mmpack.trainer.models.qwen_moe`), from a ``config.json``; its megatron-core configs.

LLaVA-OneVision-1.5's MoE checkpoints (its 30B-A3B conversion) keep the dense family's ``model_type``
``llavaonevision1_5`` and names (``visual.*``, ``model.*``, ``lm_head``), with a Qwen3-MoE ``text_config``
(``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ...) and each expert's own tensors
(``model.layers.{i}.mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, ``mlp.gate`` the router), the
Qwen3-MoE checkpoint layout. The registry sends such a config here (:func:`mmpack.trainer.models.family_of`);
the family's own key ``llavaonevision1_5_moe`` is also taken as a ``model_type``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmpack.trainer.models.llava_onevision1_5 import config as dense
from mmpack.trainer.models.protocol import TinyModelSpec
from mmpack.trainer.models.qwen_moe import (
    MoEArch,
    as_dense_text,
    moe_language_extra,
    tiny_moe_text_fields,
    with_experts,
)
from mmpack.trainer.models.vision_common import VLMegatronConfigs

MODEL_TYPE = "llavaonevision1_5_moe"
TEXT_MODEL_TYPES = ("LLaVAOneVision1_5_text", "qwen3_moe")


def has_experts(cfg: dict[str, Any]) -> bool:
    """Whether a ``llavaonevision1_5`` config's text model is a mixture of experts."""
    text = cfg.get("text_config") or {}
    return text.get("model_type") == "qwen3_moe" or bool(text.get("num_experts"))


@dataclass(kw_only=True, frozen=True)
class OneVision15MoeArch(dense.OneVision15Arch):
    """The dense architecture and the experts of its language layers."""

    moe: MoEArch


def arch_from_hf_config(cfg: dict[str, Any]) -> OneVision15MoeArch:
    """The architecture of a LLaVA-OneVision-1.5 config dict with a Qwen3-MoE text model (its router's top-k
    renormalisation as the file says, ``norm_topk_prob``)."""
    if cfg.get("model_type") not in (MODEL_TYPE, dense.MODEL_TYPE):
        raise ValueError(f"model_type is {cfg.get('model_type')!r}, expected {dense.MODEL_TYPE!r}")
    text = cfg.get("text_config") or {}
    if text.get("model_type", "qwen3_moe") not in TEXT_MODEL_TYPES:
        raise ValueError(
            f"text_config model_type {text.get('model_type')!r} is not supported ({', '.join(TEXT_MODEL_TYPES)})"
        )
    dense_cfg, moe = as_dense_text(cfg, dense.MODEL_TYPE)
    return with_experts(OneVision15MoeArch, dense.arch_from_hf_config(dense_cfg), cfg, moe)


def tiny_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """A ``config.json`` dict of a small random LLaVA-OneVision-1.5 MoE: the dense one's with a Qwen3-MoE
    ``text_config`` (4 experts of 2 per token unless ``spec`` says; each expert as wide as the hidden size
    unless ``spec.ffn_hidden_size``)."""
    config = dense.tiny_hf_config(spec)
    moe = tiny_moe_text_fields(
        spec.num_experts, spec.moe_router_topk, spec.moe_aux_loss_coeff, spec.hidden_size, spec.ffn_hidden_size
    )  # fmt: skip
    text = {**config["text_config"], "model_type": "qwen3_moe", "norm_topk_prob": True, **moe}
    return {**config, "text_config": text}


def build_transformer_configs(
    arch: OneVision15MoeArch, common: dict[str, Any], language_extra: dict[str, Any]
) -> VLMegatronConfigs:
    """The dense family's megatron-core configs, the language model's with the experts' fields."""
    return dense.build_transformer_configs(arch, common, moe_language_extra(arch.moe, language_extra))
