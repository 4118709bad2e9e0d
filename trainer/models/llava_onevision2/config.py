"""The LLaVA-OneVision-2 architecture as read from its HuggingFace ``config.json`` (``model_type``
``llava_onevision2``: ``vision_config`` of the OneVision-Encoder, ``text_config`` of a Qwen3 model), and its
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

MODEL_TYPE = "llava_onevision2"


@dataclass(kw_only=True, frozen=True)
class OneVisionEncoderArch:
    """The OneVision-Encoder (``LlavaOnevision2VisionConfig``)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 1
    frame_windows_size: int = 4
    in_channels: int = 3
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 32:
            raise ValueError(
                f"vision hidden_size {self.hidden_size} / num_attention_heads {self.num_heads} must be a multiple "
                "of 32 (the 3-D rotary split of half a head in 4:6:6 parts of 16ths)"
            )
        if self.temporal_patch_size != 1:
            raise ValueError(
                f"vision temporal_patch_size {self.temporal_patch_size}: the OneVision-Encoder takes 1"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rotary_split(self) -> tuple[int, int, int]:
        """Frequencies of the frame, row and column positions (4:6:6 of half a head)."""
        unit = self.head_dim // 32
        return 4 * unit, 6 * unit, 6 * unit


@dataclass(kw_only=True, frozen=True)
class OneVision2Arch(QwenLMArch):
    """Everything about the model that comes from ``config.json`` (sizes, special ids, RoPE)."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision: OneVisionEncoderArch
    source: dict[str, Any]  # the config.json it was read from, written back on export


def _vision_arch(v: dict[str, Any]) -> OneVisionEncoderArch:
    refuse_value(v, "vision", "hidden_act", ("gelu",))
    refuse_value(v, "vision", "layer_norm_type", ("layer_norm",))
    refuse_value(v, "vision", "use_head", (False,))
    return OneVisionEncoderArch(
        depth=int(v.get("num_hidden_layers", 24)),
        hidden_size=int(v.get("hidden_size", 1024)),
        intermediate_size=int(v.get("intermediate_size", 4096)),
        num_heads=int(v.get("num_attention_heads", 16)),
        out_hidden_size=int(v.get("out_hidden_size", 1024)),
        patch_size=int(v.get("patch_size", 14)),
        spatial_merge_size=int(v.get("spatial_merge_size", 3)),
        temporal_patch_size=int(v.get("temporal_patch_size", 1)),
        frame_windows_size=int(v.get("frame_windows_size", 4)),
        in_channels=int(v.get("num_channels", 3)),
        rope_theta=float(v.get("rope_theta", 10000.0)),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
    )


def arch_from_hf_config(cfg: dict[str, Any]) -> OneVision2Arch:
    """The architecture of a ``LlavaOnevision2ForConditionalGeneration`` config dict (Qwen3 dense text)."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise ValueError(f"model_type is {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}")
    text = cfg.get("text_config") or {}
    refuse_value(text, "text_config", "model_type", ("qwen3",))
    refuse_value(text, "text_config", "attention_bias", (False,))
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    return OneVision2Arch(
        **lm_fields(cfg, rope_1d(text, head_dim), max_positions=40960, own_head_dim=True),
        image_token_id=int(cfg.get("image_token_id", 151655)),
        video_token_id=int(cfg.get("video_token_id", 151656)),
        vision_start_token_id=int(cfg.get("vision_start_token_id", 151652)),
        vision=_vision_arch(cfg.get("vision_config") or {}),
        source=cfg,
    )


def tiny_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """A ``config.json`` dict of a small random LLaVA-OneVision-2 (its vision heads 32 wide at least)."""
    vision_hidden = max(spec.vision_hidden_size, 32 * spec.vision_num_heads)
    config = tiny_vlm_config(
        spec, architecture="LlavaOnevision2ForConditionalGeneration", model_type=MODEL_TYPE,
        text_model_type="qwen3", rope_theta=1000000.0,
    )  # fmt: skip
    return config | {
        "vision_config": {
            "model_type": "onevision_encoder",
            "hidden_size": vision_hidden,
            "intermediate_size": 2 * vision_hidden,
            "num_hidden_layers": spec.vision_depth,
            "num_attention_heads": spec.vision_num_heads,
            "num_channels": 3,
            "patch_size": spec.patch_size,
            "hidden_act": "gelu",
            "layer_norm_eps": 1e-6,
            "layer_norm_type": "layer_norm",
            "rope_theta": 10000.0,
            "use_head": False,
            "out_hidden_size": spec.hidden_size,
            "spatial_merge_size": spec.merge_size,
            "temporal_patch_size": 1,
            "frame_windows_size": 4,
        },
    }


def build_transformer_configs(
    arch: OneVision2Arch, common: dict[str, Any], language_extra: dict[str, Any]
) -> VLMegatronConfigs:
    """megatron-core configs: the Qwen3 language model (QK-norm, no QKV bias), the encoder's layers
    (LayerNorm, exact GELU, interleaved rotary pairs) and its merger MLP."""
    language = language_config(arch, common, language_extra, qkv_bias=False, qk_norm=True)
    v = arch.vision
    vision, projector = tower_configs(
        depth=v.depth, hidden_size=v.hidden_size, num_heads=v.num_heads, ffn_hidden_size=v.intermediate_size,
        merged_size=v.hidden_size * v.spatial_merge_size**2, out_size=v.out_hidden_size, common=common,
        normalization="LayerNorm", activation=F.gelu, gated=False, layernorm_epsilon=v.layer_norm_eps,
        rotary_interleaved=True,
    )  # fmt: skip
    return VLMegatronConfigs(language=language, vision=vision, projector=projector)
