"""The LLaVA-OneVision-2 architecture as read from its HuggingFace ``config.json`` (``model_type``
``llava_onevision2``: ``vision_config`` of the OneVision-Encoder, ``text_config`` of a Qwen3 model), and its
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

MODEL_TYPE = "llava_onevision2"


@dataclass(kw_only=True, frozen=True)
class OneVisionEncoderArch(ViTArch):
    """The OneVision-Encoder (``LlavaOnevision2VisionConfig``)."""

    temporal_patch_size: int = 1
    frame_windows_size: int = 4
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
    def rotary_split(self) -> tuple[int, int, int]:
        """Frequencies of the frame, row and column positions (4:6:6 of half a head)."""
        unit = self.head_dim // 32
        return 4 * unit, 6 * unit, 6 * unit


@dataclass(kw_only=True, frozen=True)
class OneVision2Arch(VLArch):
    """Everything about the model that comes from ``config.json`` (sizes, special ids, RoPE)."""

    vision: OneVisionEncoderArch


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
    fields = qwen3_text_fields(cfg, model_type=MODEL_TYPE, text_model_types=("qwen3",), max_positions=40960)
    return OneVision2Arch(**fields, vision=_vision_arch(cfg.get("vision_config") or {}))


def tiny_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """A ``config.json`` dict of a small random LLaVA-OneVision-2 (its vision heads 32 wide at least)."""
    vision_hidden = max(spec.vision_hidden_size, 32 * spec.vision_num_heads)
    config = tiny_vlm_config(
        spec, architecture="LlavaOnevision2ForConditionalGeneration", model_type=MODEL_TYPE,
        text_model_type="qwen3", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
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
    return qwen_vl_configs(
        arch, common, language_extra, qk_norm=True, vision_norm="LayerNorm", vision_activation=F.gelu,
        vision_gated=False, vision_norm_eps=arch.vision.layer_norm_eps, vision_rotary_interleaved=True,
    )  # fmt: skip


# LLaVA-OneVision-2 MoE (``model_type`` ``llava_onevision2_moe``, a ``qwen3_moe`` text model): each expert's own
# tensors, as its save_pretrained writes them (Qwen3-MoE's checkpoint layout); norm_topk_prob as the file says
EXPERTS = ExpertsFormat(
    model_type="llava_onevision2_moe",
    hf_model_types=("llava_onevision2_moe",),
    text_model_types=("qwen3_moe",),
    dense_text_model_type="qwen3",
    per_expert_files=True,
    tiny_fields={
        "architectures": ["LlavaOnevision2MoeForConditionalGeneration"],
        "model_type": "llava_onevision2_moe",
    },
    tiny_text_fields={"model_type": "qwen3_moe", "norm_topk_prob": True},
    aux_loss_at_top=True,
)
