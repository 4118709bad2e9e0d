"""Qwen3-VL (dense) behind the :class:`mmpack.trainer.models.protocol.ModelFamily` contract."""

from __future__ import annotations

import torch

from mmpack.packing.cost import ModelFlopShape, VisionFlopShape
from mmpack.packing.mrope import MRopeRule
from mmpack.trainer.models.protocol import ModelFamily
from mmpack.trainer.models.qwen3_vl import config, hf_io
from mmpack.trainer.models.qwen3_vl.vision import Qwen3VisionTower
from mmpack.trainer.models.qwen_lm import language_flop_shape
from mmpack.trainer.models.vision_common import VLMegatronConfigs
from mmpack.trainer.models.vlm_stage import build_stage


class Qwen3VLFamily(ModelFamily):
    """transformers' ``Qwen3VLForConditionalGeneration``."""

    model_type = config.MODEL_TYPE
    video_rule = "qwen3_vl"

    arch_from_hf_config = staticmethod(config.arch_from_hf_config)
    megatron_configs = staticmethod(config.build_transformer_configs)
    part_rules = staticmethod(hf_io.part_rules)
    tiny_hf_config = staticmethod(config.tiny_hf_config)

    def build_stage(
        self, arch: config.Qwen3VLArch, configs: VLMegatronConfigs, *, pre_process: bool,
        post_process: bool, use_te: bool = False, vp_stage: int | None = None,
    ) -> torch.nn.Module:  # fmt: skip
        """Its vision tower (DeepStack into the first language layers, which the first stage must hold) and
        Qwen3 language model (QK-norm, no QKV bias, interleaved MRoPE)."""
        return build_stage(
            arch, configs.language, lambda: Qwen3VisionTower(configs.vision, configs.projector, arch.vision),
            pre_process=pre_process, post_process=post_process, use_te=use_te, vp_stage=vp_stage,
            interleaved_mrope=True, deepstack_layers=arch.deepstack_layers,
        )  # fmt: skip

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
