"""The LLaVA-OneVision-1.5 architecture as read from its HuggingFace ``config.json`` (``model_type``
``llavaonevision1_5``: ``vision_config`` of the RICE-ViT, ``text_config`` of a Qwen3 model), and its
megatron-core configs. :func:`tiny_hf_config` writes the same format for random models made without a
checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

from mmpack.trainer.models.protocol import TinyModelSpec
from mmpack.trainer.models.qwen_lm import (
    QwenLMArch,
    language_config,
    lm_fields,
    refuse_value,
    rope_1d,
    tiny_vlm_config,
)
from mmpack.trainer.models.vision_common import VLMegatronConfigs, tower_configs

MODEL_TYPE = "llavaonevision1_5"
TEXT_MODEL_TYPES = ("LLaVAOneVision1_5_text", "qwen3")
ROTARY_THETA = 10000.0  # the RICE-ViT's rotary base is fixed (its config has no key for it)


@dataclass(kw_only=True, frozen=True)
class RiceViTArch:
    """The RICE-ViT (``RiceConfig``): one class token per image, LayerNorm, 2-D RoPE, biases."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the text model's hidden size (``text_hidden_size``)
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 1
    in_channels: int = 3
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"vision hidden_size {self.hidden_size} / num_heads {self.num_heads} must be a multiple of 4 "
                "(the 2-D rotary split of half a head between rows and columns)"
            )
        if self.temporal_patch_size != 1:
            raise ValueError(f"vision temporal_patch_size {self.temporal_patch_size}: the RICE-ViT takes 1")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(kw_only=True, frozen=True)
class OneVision15Arch(QwenLMArch):
    """Everything about the model that comes from ``config.json`` (sizes, special ids, RoPE)."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision: RiceViTArch
    source: dict[str, Any]  # the config.json it was read from, written back on export


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
    if cfg.get("model_type") != MODEL_TYPE:
        raise ValueError(f"model_type is {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}")
    text = cfg.get("text_config") or {}
    refuse_value(text, "text_config", "model_type", TEXT_MODEL_TYPES)
    refuse_value(text, "text_config", "attention_bias", (False,))
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"]))
    vision = _vision_arch(cfg.get("vision_config") or {})
    if vision.out_hidden_size != int(text["hidden_size"]):
        raise ValueError(
            f"vision_config text_hidden_size {vision.out_hidden_size} differs from text_config hidden_size "
            f"{text['hidden_size']}"
        )
    return OneVision15Arch(
        **lm_fields(cfg, rope_1d(text, head_dim), max_positions=32768, own_head_dim=True),
        image_token_id=int(cfg.get("image_token_id", 151655)),
        video_token_id=int(cfg.get("video_token_id", 151656)),
        vision_start_token_id=int(cfg.get("vision_start_token_id", 151652)),
        vision=vision,
        source=cfg,
    )


def tiny_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """A ``config.json`` dict of a small random LLaVA-OneVision-1.5."""
    config = tiny_vlm_config(
        spec, architecture="LLaVAOneVision1_5_ForConditionalGeneration", model_type=MODEL_TYPE,
        text_model_type=TEXT_MODEL_TYPES[0], rope_theta=1000000.0,
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
    language = language_config(arch, common, language_extra, qkv_bias=False, qk_norm=True)
    v = arch.vision
    vision, projector = tower_configs(
        depth=v.depth, hidden_size=v.hidden_size, num_heads=v.num_heads, ffn_hidden_size=v.intermediate_size,
        merged_size=v.hidden_size * v.spatial_merge_size**2, out_size=v.out_hidden_size, common=common,
        normalization="LayerNorm", activation=F.gelu, gated=False, layernorm_epsilon=v.layer_norm_eps,
    )  # fmt: skip
    return VLMegatronConfigs(language=language, vision=vision, projector=projector)
