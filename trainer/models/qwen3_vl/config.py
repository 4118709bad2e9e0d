"""The Qwen3-VL architecture (transformers' ``Qwen3VLForConditionalGeneration``) as read from a HuggingFace
``config.json`` (``text_config`` / ``vision_config``, transformers 5 layout), and its megatron-core configs.
:func:`tiny_hf_config` writes the same format for random models made without a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch.nn.functional as F

from mmpack.trainer.models.protocol import TinyModelSpec
from mmpack.trainer.models.qwen_lm import QwenLMArch, lm_fields
from mmpack.trainer.models.vision_common import VLMegatronConfigs
from mmpack.trainer.models.vlm_stage import qwen_vl_configs

MODEL_TYPE = "qwen3_vl"


@dataclass(kw_only=True, frozen=True)
class Qwen3VisionArch:
    """The vision tower (transformers' ``Qwen3VLVisionConfig``)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        side = int(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings {self.num_position_embeddings} is not a square")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ValueError(
                f"deepstack_visual_indexes {self.deepstack_visual_indexes} out of 0..{self.depth - 1}"
            )
        if self.hidden_act != "gelu_pytorch_tanh":
            raise ValueError("only vision hidden_act 'gelu_pytorch_tanh' is supported")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        """Side of the square grid of learned position embeddings."""
        return int(self.num_position_embeddings**0.5)


@dataclass(kw_only=True, frozen=True)
class Qwen3VLArch(QwenLMArch):
    """Everything about the model that comes from ``config.json`` (sizes, special ids, RoPE)."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision: Qwen3VisionArch
    source: dict[str, Any]  # the config.json it was read from, written back on export

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.vision.deepstack_visual_indexes) > self.num_layers:
            raise ValueError("more DeepStack features than language layers to take them")

    @property
    def deepstack_layers(self) -> int:
        """Early language layers that take DeepStack features (the first ones, one feature each)."""
        return len(self.vision.deepstack_visual_indexes)


def _rope(text: dict[str, Any]) -> tuple[float, tuple[int, int, int]]:
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {params.get('rope_type')!r} is not supported (default only)")
    section = params.get("mrope_section") or [24, 20, 20]
    if len(section) != 3:
        raise ValueError(f"mrope_section {section} must have 3 parts (temporal, height, width)")
    theta = params.get("rope_theta", text.get("rope_theta", 500000.0))
    return float(theta), (int(section[0]), int(section[1]), int(section[2]))


def _vision_arch(v: dict[str, Any], out: int) -> Qwen3VisionArch:
    return Qwen3VisionArch(
        depth=int(v["depth"]),
        hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        num_heads=int(v["num_heads"]),
        out_hidden_size=int(v.get("out_hidden_size", out)),
        num_position_embeddings=int(v.get("num_position_embeddings", 2304)),
        deepstack_visual_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes", (8, 16, 24))),
        patch_size=int(v.get("patch_size", 16)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        in_channels=int(v.get("in_channels", 3)),
        rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
    )


def arch_from_hf_config(cfg: dict[str, Any]) -> Qwen3VLArch:
    """The architecture of a ``Qwen3VLForConditionalGeneration`` config dict."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise ValueError(f"model_type is {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}")
    text = cfg.get("text_config") or {}
    if text.get("attention_bias"):
        raise ValueError("attention_bias true is not supported (Qwen3-VL has no QKV bias)")
    return Qwen3VLArch(
        **lm_fields(cfg, _rope(text), max_positions=128000, own_head_dim=True),
        image_token_id=int(cfg.get("image_token_id", 151655)),
        video_token_id=int(cfg.get("video_token_id", 151656)),
        vision_start_token_id=int(cfg.get("vision_start_token_id", 151652)),
        vision=_vision_arch(cfg.get("vision_config") or {}, int(text["hidden_size"])),
        source=cfg,
    )


def tiny_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """A ``config.json`` dict (transformers 5 layout) of a small random Qwen3-VL: DeepStack from every vision
    layer but the last into the first language layers, a 16 x 16 grid of learned position embeddings."""
    head_dim = spec.hidden_size // spec.num_attention_heads
    half = head_dim // 2
    spatial = 5 * half // 16  # Qwen3-VL's [24, 20, 20] split of 64 rotary frequencies, scaled
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": MODEL_TYPE,
        "image_token_id": spec.image_token_id,
        "video_token_id": spec.image_token_id + 1,
        "vision_start_token_id": spec.vision_start_token_id,
        "vision_end_token_id": spec.vision_end_token_id,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "text_config": {
            "model_type": "qwen3_vl_text",
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.ffn_hidden_size or 4 * spec.hidden_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_key_value_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": spec.max_position_embeddings,
            "attention_bias": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_interleaved": True,
                "mrope_section": [half - 2 * spatial, spatial, spatial],
            },
            "tie_word_embeddings": spec.tie_word_embeddings,
        },
        "vision_config": {
            "model_type": "qwen3_vl_vision",
            "depth": spec.vision_depth,
            "hidden_size": spec.vision_hidden_size,
            "intermediate_size": 2 * spec.vision_hidden_size,
            "num_heads": spec.vision_num_heads,
            "out_hidden_size": spec.hidden_size,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": list(range(min(spec.vision_depth - 1, spec.num_layers // 2))),
            "patch_size": spec.patch_size,
            "temporal_patch_size": 2,
            "spatial_merge_size": spec.merge_size,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        },
    }


def build_transformer_configs(
    arch: Any, common: dict[str, Any], language_extra: dict[str, Any]
) -> VLMegatronConfigs:
    """megatron-core configs from the architecture; ``common`` holds the run's parallel/precision fields."""
    return qwen_vl_configs(
        arch, common, language_extra, qk_norm=True, vision_norm="LayerNorm",
        vision_activation=partial(F.gelu, approximate="tanh"), vision_gated=False,
    )  # fmt: skip
