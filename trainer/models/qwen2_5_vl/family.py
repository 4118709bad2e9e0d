"""Qwen2.5-VL behind the :class:`mmpack.trainer.models.protocol.ModelFamily` contract."""

from __future__ import annotations

from mmpack.packing.cost import ModelFlopShape, VisionFlopShape
from mmpack.packing.mrope import MRopeRule
from mmpack.trainer.models.qwen2_5_vl import config, hf_io
from mmpack.trainer.models.qwen2_5_vl.vision import VisionTower
from mmpack.trainer.models.qwen_lm import language_flop_shape
from mmpack.trainer.models.vlm_stage import TowerFamily


class Qwen25VLFamily(TowerFamily[config.Qwen25VLArch]):
    """transformers' ``Qwen2_5_VLForConditionalGeneration``: its vision tower (window attention) and Qwen2.5
    language model (QKV bias, MRoPE in sections)."""

    model_type = config.MODEL_TYPE
    hf_model_types = (config.MODEL_TYPE,)
    video_rule = "qwen-vl-utils"
    hf = hf_io.Qwen25VLWeights()
    tower = VisionTower

    arch_from_hf_config = staticmethod(config.arch_from_hf_config)
    megatron_configs = staticmethod(config.build_transformer_configs)
    tiny_hf_config = staticmethod(config.tiny_hf_config)  # no experts (a flag asking for them is refused)

    def position_rule(self, arch: config.Qwen25VLArch) -> MRopeRule:
        return MRopeRule(
            image_pad_id=arch.image_token_id, merge_size=arch.vision.spatial_merge_size,
            video_pad_id=arch.video_token_id, tokens_per_second=arch.tokens_per_second,
        )  # fmt: skip

    def flop_shape(self, arch: config.Qwen25VLArch) -> ModelFlopShape:
        v = arch.vision
        side = v.window_size // v.spatial_merge_size // v.patch_size * v.spatial_merge_size
        return ModelFlopShape(
            language=language_flop_shape(arch),
            vision=VisionFlopShape(
                hidden_size=v.hidden_size, num_layers=v.depth, ffn_hidden_size=v.intermediate_size,
                patch_pixels=v.in_channels * v.temporal_patch_size * v.patch_size**2,
                full_attention_layers=len(v.fullatt_block_indexes), window_patches=side * side,
                merge_units=v.spatial_merge_size**2, out_hidden_size=arch.hidden_size,
            ),
        )  # fmt: skip


FAMILY = Qwen25VLFamily()
