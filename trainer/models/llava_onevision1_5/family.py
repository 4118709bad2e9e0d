"""LLaVA-OneVision-1.5 behind the :class:`mmpack.trainer.models.protocol.ModelFamily` contract, and its
mixture-of-experts variant (:func:`mmpack.trainer.models.moe_variant.with_experts`)."""

from __future__ import annotations

from typing import Any

from mmpack.packing.cost import ModelFlopShape
from mmpack.packing.patch_positions import TextPositionRule
from mmpack.trainer.models.llava_onevision1_5 import config, hf_io
from mmpack.trainer.models.llava_onevision1_5.vision import RiceViT
from mmpack.trainer.models.moe_variant import with_experts
from mmpack.trainer.models.qwen_lm import language_flop_shape
from mmpack.trainer.models.qwen_moe import text_has_experts
from mmpack.trainer.models.vision_common import single_merger_flop_shape
from mmpack.trainer.models.vlm_stage import TowerFamily


class OneVision15Family(TowerFamily[config.OneVision15Arch]):
    """``LLaVAOneVision1_5_ForConditionalGeneration`` with a Qwen3 dense text model: the RICE-ViT and the Qwen3
    language model (QK-norm, no QKV bias, 1-D RoPE)."""

    model_type = config.MODEL_TYPE
    hf_model_types = (config.MODEL_TYPE,)
    video_rule = "llava_onevision1_5"  # no packer rule: a dataset with videos is refused for this family
    tower = RiceViT
    hf = hf_io.OneVision15Weights()

    arch_from_hf_config = staticmethod(config.arch_from_hf_config)
    megatron_configs = staticmethod(config.build_transformer_configs)
    tiny_hf_config = staticmethod(config.tiny_hf_config)

    def claims(self, hf_config: dict[str, Any]) -> bool:
        """Its ``model_type`` with a dense text model: the MoE checkpoints keep this ``model_type``
        (:data:`config.EXPERTS`, the MoE variant's)."""
        return super().claims(hf_config) and not text_has_experts(hf_config)

    def position_rule(self, arch: config.OneVision15Arch) -> TextPositionRule:
        """1-D text positions per sample, and each image patch's (frame, row, column) for the ViT's rotary."""
        return TextPositionRule(merge_size=arch.vision.spatial_merge_size)

    def flop_shape(self, arch: config.OneVision15Arch) -> ModelFlopShape:
        return ModelFlopShape(
            language=language_flop_shape(arch), vision=single_merger_flop_shape(arch.vision)
        )


FAMILY = OneVision15Family()
MOE_FAMILY = with_experts(FAMILY, config.EXPERTS)  # LLaVA-OneVision-1.5 MoE (a Qwen3-MoE text model)
