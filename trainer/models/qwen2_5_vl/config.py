"""The Qwen2.5-VL architecture as read from a HuggingFace ``config.json``, and its megatron-core configs.

Both layouts of the file are read: transformers 5 (``text_config`` / ``rope_parameters``) and 4.x (text
fields at the top level, ``rope_theta`` + ``rope_scaling``). :func:`tiny_hf_config` writes the same format
for random models made without a checkpoint (presets and size flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

from mmpack.trainer.models.qwen_lm import QwenLMArch, lm_fields
from mmpack.trainer.models.vision_common import VLMegatronConfigs
from mmpack.trainer.models.vlm_stage import qwen_vl_configs

MODEL_TYPE = "qwen2_5_vl"


@dataclass(kw_only=True, frozen=True)
class VisionArch:
    """The vision tower (transformers' ``Qwen2_5_VLVisionConfig``)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    hidden_act: str = "silu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(kw_only=True, frozen=True)
class Qwen25VLArch(QwenLMArch):
    """Everything about the model that comes from ``config.json`` (sizes, special ids, RoPE)."""

    image_token_id: int
    vision_start_token_id: int
    vision: VisionArch
    source: dict[str, Any]  # the config.json it was read from, written back on export

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.vision.hidden_act != "silu":
            raise ValueError("only hidden_act 'silu' (SwiGLU) is supported")

    @property
    def video_token_id(self) -> int:
        """The ``<|video_pad|>`` id of config.json (151656, Qwen2.5-VL's, where it has none)."""
        return int(self.source.get("video_token_id", 151656))

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
    if cfg.get("model_type") != MODEL_TYPE:
        raise ValueError(f"model_type is {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}")
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
        image_token_id=int(cfg.get("image_token_id", 151655)),
        vision_start_token_id=int(cfg.get("vision_start_token_id", 151652)),
        vision=vision,
        source=cfg,
    )


def tiny_hf_config(
    *,
    vocab_size: int,
    image_token_id: int,
    vision_start_token_id: int,
    vision_end_token_id: int,
    num_layers: int = 4,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    ffn_hidden_size: int | None = None,
    vision_depth: int = 2,
    vision_hidden_size: int = 32,
    vision_num_heads: int = 2,
    patch_size: int = 14,
    merge_size: int = 2,
    max_position_embeddings: int = 32768,
    tie_word_embeddings: bool = False,
) -> dict[str, Any]:
    """A ``config.json`` dict (transformers 5 layout) of a small random Qwen2.5-VL."""
    head_dim = hidden_size // num_attention_heads
    half = head_dim // 2
    spatial = 3 * half // 8  # Qwen2.5-VL's [16, 24, 24] split of 64 rotary frequencies, scaled
    section = [half - 2 * spatial, spatial, spatial]
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": MODEL_TYPE,
        "image_token_id": image_token_id,
        "video_token_id": image_token_id + 1,
        "vision_start_token_id": vision_start_token_id,
        "vision_end_token_id": vision_end_token_id,
        "tie_word_embeddings": tie_word_embeddings,
        "text_config": {
            "model_type": "qwen2_5_vl_text",
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": ffn_hidden_size or 4 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_attention_heads,
            "num_key_value_heads": num_key_value_heads,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section},
            "tie_word_embeddings": tie_word_embeddings,
        },
        "vision_config": {
            "model_type": "qwen2_5_vl_vision",
            "depth": vision_depth,
            "hidden_size": vision_hidden_size,
            "intermediate_size": 2 * vision_hidden_size,
            "num_heads": vision_num_heads,
            "out_hidden_size": hidden_size,
            "patch_size": patch_size,
            "temporal_patch_size": 2,
            "spatial_merge_size": merge_size,
            "window_size": patch_size * merge_size * 2,
            "fullatt_block_indexes": [vision_depth - 1],
            "hidden_act": "silu",
            "in_channels": 3,
            "tokens_per_second": 2,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        },
    }


def build_transformer_configs(
    arch: Any, common: dict[str, Any], language_extra: dict[str, Any]
) -> VLMegatronConfigs:
    """megatron-core configs from the architecture; ``common`` holds the run's parallel/precision fields."""
    return qwen_vl_configs(
        arch, common, language_extra, qk_norm=False, vision_norm="RMSNorm", vision_activation=F.silu, vision_gated=True
    )  # fmt: skip
