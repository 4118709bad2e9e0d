"""The Qwen2.5-VL architecture as read from a HuggingFace ``config.json``, and its megatron-core configs.

Both layouts of the file are read: transformers 5 (``text_config`` / ``rope_parameters``) and 4.x (text
fields at the top level, ``rope_theta`` + ``rope_scaling``). :func:`tiny_hf_config` writes the same format
for random models made without a checkpoint (presets and size flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

from mmpack.trainer.models.protocol import TinyModelSpec
from mmpack.trainer.models.qwen_lm import VLArch, expect_model_type, lm_fields, special_ids, tiny_vlm_config
from mmpack.trainer.models.vision_common import ViTArch, VLMegatronConfigs
from mmpack.trainer.models.vlm_stage import qwen_vl_configs

MODEL_TYPE = "qwen2_5_vl"


@dataclass(kw_only=True, frozen=True)
class VisionArch(ViTArch):
    """The vision tower (transformers' ``Qwen2_5_VLVisionConfig``)."""

    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    hidden_act: str = "silu"


@dataclass(kw_only=True, frozen=True)
class Qwen25VLArch(VLArch):
    """Everything about the model that comes from ``config.json`` (sizes, special ids, RoPE)."""

    vision: VisionArch

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.vision.hidden_act != "silu":
            raise ValueError("only hidden_act 'silu' (SwiGLU) is supported")

    @property
    def tokens_per_second(self) -> float:
        """MRoPE temporal positions per second of video (``vision_config.tokens_per_second``, 2 by default)."""
        return float((self.source.get("vision_config") or {}).get("tokens_per_second", 2))


def _rope(text: dict[str, Any]) -> tuple[float, tuple[int, int, int]]:
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    theta = params.get("rope_theta", text.get("rope_theta", 1_000_000.0))
    section = params.get("mrope_section") or scaling.get("mrope_section")
    if not section or len(section) != 3:
        raise ValueError("config.json has no 3-part mrope_section (rope_parameters or rope_scaling)")
    return float(theta), (int(section[0]), int(section[1]), int(section[2]))


def arch_from_hf_config(cfg: dict[str, Any]) -> Qwen25VLArch:
    """The architecture of a ``Qwen2_5_VLForConditionalGeneration`` config dict."""
    expect_model_type(cfg, MODEL_TYPE)
    text = {**cfg, **(cfg.get("text_config") or {})}
    v = cfg.get("vision_config") or {}
    theta, section = _rope(text)
    vrope = (v.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    vision = VisionArch(
        depth=int(v["depth"]),
        hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        num_heads=int(v["num_heads"]),
        out_hidden_size=int(v.get("out_hidden_size", text["hidden_size"])),
        patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        in_channels=int(v.get("in_channels", 3)),
        window_size=int(v.get("window_size", 112)),
        fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", ())),
        rope_theta=float(vrope),
        hidden_act=str(v.get("hidden_act", "silu")),
    )
    return Qwen25VLArch(
        **lm_fields(cfg, (theta, section), max_positions=32768, own_head_dim=False),
        **special_ids(cfg),
        vision=vision,
        source=cfg,
    )


def tiny_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """A ``config.json`` dict (transformers 5 layout) of a small random Qwen2.5-VL."""
    head_dim = spec.hidden_size // spec.num_attention_heads
    half = head_dim // 2
    spatial = 3 * half // 8  # Qwen2.5-VL's [16, 24, 24] split of 64 rotary frequencies, scaled
    section = [half - 2 * spatial, spatial, spatial]
    config = tiny_vlm_config(
        spec, architecture="Qwen2_5_VLForConditionalGeneration", model_type=MODEL_TYPE,
        text_model_type="qwen2_5_vl_text", qwen3=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section},
    )  # fmt: skip
    return config | {
        "vision_config": {
            "model_type": "qwen2_5_vl_vision",
            "depth": spec.vision_depth,
            "hidden_size": spec.vision_hidden_size,
            "intermediate_size": 2 * spec.vision_hidden_size,
            "num_heads": spec.vision_num_heads,
            "out_hidden_size": spec.hidden_size,
            "patch_size": spec.patch_size,
            "temporal_patch_size": 2,
            "spatial_merge_size": spec.merge_size,
            "window_size": spec.patch_size * spec.merge_size * 2,
            "fullatt_block_indexes": [spec.vision_depth - 1],
            "hidden_act": "silu",
            "in_channels": 3,
            "tokens_per_second": 2,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        },
    }


def build_transformer_configs(
    arch: Qwen25VLArch, common: dict[str, Any], language_extra: dict[str, Any]
) -> VLMegatronConfigs:
    """megatron-core configs from the architecture; ``common`` holds the run's parallel/precision fields."""
    return qwen_vl_configs(
        arch, common, language_extra, qk_norm=False, vision_norm="RMSNorm", vision_activation=F.silu, vision_gated=True
    )  # fmt: skip
