"""The Qwen3-VL architecture (transformers' ``Qwen3VLForConditionalGeneration``) as read from a HuggingFace
``config.json`` (``text_config`` / ``vision_config``, transformers 5 layout), and its megatron-core configs.
:func:`tiny_hf_config` writes the same format for random models made without a checkpoint; :data:`EXPERTS` is
how Qwen3-VL-MoE's files hold its experts."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch.nn.functional as F

from mmpack.trainer.models.moe_variant import ExpertsFormat
from mmpack.trainer.models.protocol import TinyModelSpec
from mmpack.trainer.models.qwen_lm import VLArch, expect_model_type, lm_fields, special_ids, tiny_vlm_config
from mmpack.trainer.models.vision_common import ViTArch, VLMegatronConfigs
from mmpack.trainer.models.vlm_stage import qwen_vl_configs

MODEL_TYPE = "qwen3_vl"


@dataclass(kw_only=True, frozen=True)
class Qwen3VisionArch(ViTArch):
    """The vision tower (transformers' ``Qwen3VLVisionConfig``)."""

    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    patch_size: int = 16
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
    def grid_side(self) -> int:
        """Side of the square grid of learned position embeddings."""
        return int(self.num_position_embeddings**0.5)


@dataclass(kw_only=True, frozen=True)
class Qwen3VLArch(VLArch):
    """Everything about the model that comes from ``config.json`` (sizes, special ids, RoPE)."""

    vision: Qwen3VisionArch

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
    expect_model_type(cfg, MODEL_TYPE)
    text = cfg.get("text_config") or {}
    if text.get("attention_bias"):
        raise ValueError("attention_bias true is not supported (Qwen3-VL has no QKV bias)")
    return Qwen3VLArch(
        **lm_fields(cfg, _rope(text), max_positions=128000, own_head_dim=True),
        **special_ids(cfg),
        vision=_vision_arch(cfg.get("vision_config") or {}, int(text["hidden_size"])),
        source=cfg,
    )


def tiny_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """A ``config.json`` dict (transformers 5 layout) of a small random Qwen3-VL: DeepStack from every vision
    layer but the last into the first language layers, a 16 x 16 grid of learned position embeddings."""
    head_dim = spec.hidden_size // spec.num_attention_heads
    half = head_dim // 2
    spatial = 5 * half // 16  # Qwen3-VL's [24, 20, 20] split of 64 rotary frequencies, scaled
    rope = {
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_interleaved": True,
        "mrope_section": [half - 2 * spatial, spatial, spatial],
    }
    config = tiny_vlm_config(
        spec, architecture="Qwen3VLForConditionalGeneration", model_type=MODEL_TYPE,
        text_model_type="qwen3_vl_text", rope_parameters=rope,
    )  # fmt: skip
    return config | {
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
    arch: Qwen3VLArch, common: dict[str, Any], language_extra: dict[str, Any]
) -> VLMegatronConfigs:
    """megatron-core configs from the architecture; ``common`` holds the run's parallel/precision fields."""
    return qwen_vl_configs(
        arch, common, language_extra, qk_norm=True, vision_norm="LayerNorm",
        vision_activation=partial(F.gelu, approximate="tanh"), vision_gated=False,
    )  # fmt: skip


# Qwen3-VL-MoE (transformers' ``Qwen3VLMoeForConditionalGeneration``): experts in every language layer, stacked
# in transformers 5's tensors; its router always renormalises the top-k probabilities
EXPERTS = ExpertsFormat(
    model_type="qwen3_vl_moe",
    hf_model_types=("qwen3_vl_moe",),
    norm_topk_prob=True,
    tiny_fields={"architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe"},
    tiny_text_fields={"model_type": "qwen3_vl_moe_text"},
    tiny_vision_fields={"model_type": "qwen3_vl_moe_vision"},
)
