"""LLaVA-OneVision-2 behind the :class:`mmpack.trainer.models.protocol.ModelFamily` contract, and its
mixture-of-experts variant (:func:`mmpack.trainer.models.moe_variant.with_experts`)."""

from __future__ import annotations

from mmpack.packing.cost import ModelFlopShape
from mmpack.packing.patch_positions import TextPositionRule
from mmpack.trainer.models.llava_onevision2 import config, hf_io
from mmpack.trainer.models.llava_onevision2.vision import OneVisionEncoder
from mmpack.trainer.models.moe_variant import with_experts
from mmpack.trainer.models.qwen_lm import language_flop_shape
from mmpack.trainer.models.vision_common import single_merger_flop_shape
from mmpack.trainer.models.vlm_stage import TowerFamily


class OneVision2Family(TowerFamily[config.OneVision2Arch]):
    """``LlavaOnevision2ForConditionalGeneration`` with a Qwen3 dense text model: the OneVision-Encoder and
    the Qwen3 language model (QK-norm, no QKV bias, 1-D RoPE)."""

    model_type = config.MODEL_TYPE
    hf_model_types = (config.MODEL_TYPE,)
    video_rule = "llava_onevision2"  # its video frames are images to the model (dataloader/collate.py)
    tower = OneVisionEncoder
    hf = hf_io.OneVision2Weights()

    arch_from_hf_config = staticmethod(config.arch_from_hf_config)
    megatron_configs = staticmethod(config.build_transformer_configs)
    tiny_hf_config = staticmethod(config.tiny_hf_config)

    def position_rule(self, arch: config.OneVision2Arch) -> TextPositionRule:
        """1-D text positions per sample, and each image patch's (frame, row, column) for the encoder."""
        return TextPositionRule(merge_size=arch.vision.spatial_merge_size)

    def flop_shape(self, arch: config.OneVision2Arch) -> ModelFlopShape:
        return ModelFlopShape(
            language=language_flop_shape(arch), vision=single_merger_flop_shape(arch.vision)
        )


FAMILY = OneVision2Family()
MOE_FAMILY = with_experts(FAMILY, config.EXPERTS)  # LLaVA-OneVision-2 MoE (a Qwen3-MoE text model)
