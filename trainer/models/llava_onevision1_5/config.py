"""The LLaVA-OneVision-1.5 architecture as read from its HuggingFace ``config.json`` (``model_type``
``llavaonevision1_5``: ``vision_config`` of the RICE-ViT, ``text_config`` of a Qwen3 model), and its
megatron-core configs. :func:`tiny_hf_config` writes the same format for random models made without a
checkpoint; :data:`EXPERTS` is how the MoE variant's files hold its experts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

from mmpack.trainer.models.moe_variant import ExpertsFormat
from mmpack.trainer.models.protocol import TinyModelSpec
from mmpack.trainer.models.qwen_lm import VLArch, qwen3_text_fields, refuse_value, tiny_vlm_config
from mmpack.trainer.models.vision_common import ViTArch, VLMegatronConfigs
from mmpack.trainer.models.vlm_stage import qwen_vl_configs

MODEL_TYPE = "llavaonevision1_5"
TEXT_MODEL_TYPES = ("LLaVAOneVision1_5_text", "qwen3")
ROTARY_THETA = 10000.0  # the RICE-ViT's rotary base is fixed (its config has no key for it)


@dataclass(kw_only=True, frozen=True)
class RiceViTArch(ViTArch):
    """The RICE-ViT (``RiceConfig``): one class token per image, LayerNorm, 2-D RoPE, biases."""

    temporal_patch_size: int = 1
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"vision hidden_size {self.hidden_size} / num_heads {self.num_heads} must be a multiple of 4 "
                "(the 2-D rotary split of half a head between rows and columns)"
            )
        if self.temporal_patch_size != 1:
            raise ValueError(f"vision temporal_patch_size {self.temporal_patch_size}: the RICE-ViT takes 1")


@dataclass(kw_only=True, frozen=True)
class OneVision15Arch(VLArch):
    """Everything about the model that comes from ``config.json`` (sizes, special ids, RoPE)."""

    vision: RiceViTArch


def _vision_arch(v: dict[str, Any]) -> RiceViTArch:
    refuse_value(v, "vision_config", "hidden_act", ("gelu",))
    return RiceViTArch(
        depth=int(v.get("depth", 24)),
        hidden_size=int(v.get("hidden_size", 1024)),
        intermediate_size=int(v.get("intermediate_size", 4096)),
        num_heads=int(v.get("num_heads", 16)),
        out_hidden_size=int(v.get("text_hidden_size", 2560)),
        patch_size=int(v.get("patch_size", 14)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        temporal_patch_size=int(v.get("temporal_patch_size", 1)),
        in_channels=int(v.get("in_channels", 3)),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-5)),
    )


def arch_from_hf_config(cfg: dict[str, Any]) -> OneVision15Arch:
    """The architecture of a ``LLaVAOneVision1_5_ForConditionalGeneration`` config dict (Qwen3 dense text)."""
    fields = qwen3_text_fields(
        cfg, model_type=MODEL_TYPE, text_model_types=TEXT_MODEL_TYPES, max_positions=32768
    )
    vision = _vision_arch(cfg.get("vision_config") or {})
    if vision.out_hidden_size != fields["hidden_size"]:
        raise ValueError(
            f"vision_config text_hidden_size {vision.out_hidden_size} differs from text_config hidden_size "
            f"{fields['hidden_size']}"
        )
    return OneVision15Arch(**fields, vision=vision)


def tiny_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """A ``config.json`` dict of a small random LLaVA-OneVision-1.5."""
    config = tiny_vlm_config(
        spec, architecture="LLaVAOneVision1_5_ForConditionalGeneration", model_type=MODEL_TYPE,
        text_model_type=TEXT_MODEL_TYPES[0], rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )  # fmt: skip
    return config | {
        "vocab_size": spec.vocab_size,
        "vision_config": {
            "model_type": "rice_vit",
            "depth": spec.vision_depth,
            "embed_dim": spec.vision_hidden_size,
            "hidden_size": spec.vision_hidden_size,
            "hidden_act": "gelu",
            "intermediate_size": 4 * spec.vision_hidden_size,
            "num_heads": spec.vision_num_heads,
            "in_channels": 3,
            "patch_size": spec.patch_size,
            "spatial_merge_size": spec.merge_size,
            "temporal_patch_size": 1,
            "layer_norm_eps": 1e-5,
            "text_hidden_size": spec.hidden_size,
        },
    }


def build_transformer_configs(
    arch: OneVision15Arch, common: dict[str, Any], language_extra: dict[str, Any]
) -> VLMegatronConfigs:
    """megatron-core configs: the Qwen3 language model (QK-norm, no QKV bias), the RICE-ViT's layers
    (LayerNorm, exact GELU, biases, rotary over the two halves of a head) and its merger MLP."""
    return qwen_vl_configs(
        arch, common, language_extra, qk_norm=True, vision_norm="LayerNorm", vision_activation=F.gelu,
        vision_gated=False, vision_norm_eps=arch.vision.layer_norm_eps,
    )  # fmt: skip


# LLaVA-OneVision-1.5 MoE (its 30B-A3B conversion): the dense model_type and names (``visual.*``, ``model.*``,
# ``lm_head``) with a Qwen3-MoE text_config (``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
# ...) and each expert's own tensors (``model.layers.{i}.mlp.experts.{e}.gate_proj`` / ``up_proj`` /
# ``down_proj``, ``mlp.gate`` the router), Qwen3-MoE's checkpoint layout; the variant's own name
# ``llavaonevision1_5_moe`` is also taken as a model_type
EXPERTS = ExpertsFormat(
    model_type="llavaonevision1_5_moe",
    hf_model_types=("llavaonevision1_5_moe", MODEL_TYPE),
    text_model_types=("qwen3_moe", TEXT_MODEL_TYPES[0]),
    dense_text_model_type="qwen3",
    per_expert_files=True,
    tiny_text_fields={"model_type": "qwen3_moe", "norm_topk_prob": True},
)
