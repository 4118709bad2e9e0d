"""Qwen3-VL behind the :class:`mmpack.trainer.models.protocol.ModelFamily` contract, and its mixture-of-experts
variant Qwen3-VL-MoE (:func:`mmpack.trainer.models.moe_variant.with_experts`)."""

from __future__ import annotations

from mmpack.packing.cost import ModelFlopShape, VisionFlopShape
from mmpack.packing.mrope import MRopeRule
from mmpack.trainer.models.moe_variant import with_experts
from mmpack.trainer.models.qwen3_vl import config, hf_io
from mmpack.trainer.models.qwen3_vl.vision import Qwen3VisionTower
from mmpack.trainer.models.qwen_lm import language_flop_shape
from mmpack.trainer.models.vlm_stage import TowerFamily


class Qwen3VLFamily(TowerFamily[config.Qwen3VLArch]):
    """transformers' ``Qwen3VLForConditionalGeneration``: its vision tower (DeepStack into the first language
    layers, which the first stage must hold) and Qwen3 language model (QK-norm, no QKV bias, interleaved
    MRoPE)."""

    model_type = config.MODEL_TYPE
    hf_model_types = (config.MODEL_TYPE,)
    video_rule = "qwen3_vl"
    hf = hf_io.Qwen3VLWeights()
    adapter_prefixes = ("vision.merger.", "vision.deepstack_mergers.")
    tower = Qwen3VisionTower
    interleaved_mrope = True

    arch_from_hf_config = staticmethod(config.arch_from_hf_config)
    megatron_configs = staticmethod(config.build_transformer_configs)
    tiny_hf_config = staticmethod(config.tiny_hf_config)

    def deepstack_layers(self, arch: config.Qwen3VLArch) -> int:
        return arch.deepstack_layers

    def position_rule(self, arch: config.Qwen3VLArch) -> MRopeRule:
        """Images as Qwen2.5-VL's; each temporal patch of a video is its own run of pads (timestamps between)."""
        return MRopeRule(
            image_pad_id=arch.image_token_id, merge_size=arch.vision.spatial_merge_size,
            video_pad_id=arch.video_token_id, video_frames_apart=True,
        )  # fmt: skip

    def flop_shape(self, arch: config.Qwen3VLArch) -> ModelFlopShape:
        v = arch.vision
        return ModelFlopShape(
            language=language_flop_shape(arch),
            vision=VisionFlopShape(
                hidden_size=v.hidden_size, num_layers=v.depth, ffn_hidden_size=v.intermediate_size,
                gated_mlp=False, patch_pixels=v.in_channels * v.temporal_patch_size * v.patch_size**2,
                merge_units=v.spatial_merge_size**2, out_hidden_size=v.out_hidden_size,
                mergers=1 + len(v.deepstack_visual_indexes),
            ),
        )  # fmt: skip


FAMILY = Qwen3VLFamily()
MOE_FAMILY = with_experts(FAMILY, config.EXPERTS)  # Qwen3-VL-MoE
