"""LLaVA-OneVision-2 (dense) behind the :class:`mmpack.trainer.models.protocol.ModelFamily` contract."""

from __future__ import annotations

import torch

from mmpack.packing.cost import ModelFlopShape
from mmpack.packing.patch_positions import TextPositionRule
from mmpack.trainer.models.llava_onevision2 import config, hf_io
from mmpack.trainer.models.llava_onevision2.vision import OneVisionEncoder
from mmpack.trainer.models.protocol import ModelFamily
from mmpack.trainer.models.qwen_lm import language_flop_shape
from mmpack.trainer.models.vision_common import VLMegatronConfigs, single_merger_flop_shape
from mmpack.trainer.models.vlm_stage import build_stage


class OneVision2Family(ModelFamily):
    """``LlavaOnevision2ForConditionalGeneration`` with a Qwen3 dense text model."""

    model_type = config.MODEL_TYPE
    video_rule = "llava_onevision2"  # its video frames are images to the model (dataloader/collate.py)

    arch_from_hf_config = staticmethod(config.arch_from_hf_config)
    megatron_configs = staticmethod(config.build_transformer_configs)
    part_rules = staticmethod(hf_io.part_rules)
    tiny_hf_config = staticmethod(config.tiny_hf_config)

    def build_stage(
        self, arch: config.OneVision2Arch, configs: VLMegatronConfigs, *, pre_process: bool,
        post_process: bool, use_te: bool = False, vp_stage: int | None = None,
    ) -> torch.nn.Module:  # fmt: skip
        """The OneVision-Encoder and the Qwen3 language model (QK-norm, no QKV bias, 1-D RoPE)."""
        return build_stage(
            arch, configs.language, lambda: OneVisionEncoder(configs.vision, configs.projector, arch.vision),
            pre_process=pre_process, post_process=post_process, use_te=use_te, vp_stage=vp_stage,
        )  # fmt: skip

    def position_rule(self, arch: config.OneVision2Arch) -> TextPositionRule:
        """1-D text positions per sample, and each image patch's (frame, row, column) for the encoder."""
        return TextPositionRule(merge_size=arch.vision.spatial_merge_size)

    def flop_shape(self, arch: config.OneVision2Arch) -> ModelFlopShape:
        return ModelFlopShape(
            language=language_flop_shape(arch), vision=single_merger_flop_shape(arch.vision)
        )


FAMILY = OneVision2Family()
