"""Qwen2.5-VL behind the :class:`mmpack.trainer.models.protocol.ModelFamily` contract."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from mmpack.packing.cost import ModelFlopShape, VisionFlopShape
from mmpack.packing.mrope import MRopeRule
from mmpack.trainer.models.protocol import ModelFamily, TinyModelSpec
from mmpack.trainer.models.qwen2_5_vl import config, hf_check, hf_io
from mmpack.trainer.models.qwen2_5_vl.vision import VisionTower
from mmpack.trainer.models.qwen_lm import language_flop_shape
from mmpack.trainer.models.vision_common import VLMegatronConfigs
from mmpack.trainer.models.vlm_stage import build_stage


class Qwen25VLFamily(ModelFamily):
    """transformers' ``Qwen2_5_VLForConditionalGeneration``."""

    model_type = config.MODEL_TYPE
    video_rule = "qwen-vl-utils"

    arch_from_hf_config = staticmethod(config.arch_from_hf_config)
    megatron_configs = staticmethod(config.build_transformer_configs)
    part_rules = staticmethod(hf_io.part_rules)
    hf_tensor_shapes = staticmethod(hf_check.hf_tensor_shapes)  # type: ignore[assignment]

    def tiny_hf_config(self, spec: TinyModelSpec) -> dict[str, Any]:
        dense = {
            k: v
            for k, v in asdict(spec).items()
            if k not in ("num_experts", "moe_router_topk", "moe_aux_loss_coeff")
        }
        return config.tiny_hf_config(**dense)  # no experts (a flag asking for them is refused by the trainer)

    def build_stage(
        self, arch: config.Qwen25VLArch, configs: VLMegatronConfigs, *, pre_process: bool,
        post_process: bool, use_te: bool = False, vp_stage: int | None = None,
    ) -> torch.nn.Module:  # fmt: skip
        """Its vision tower (window attention) and Qwen2.5 language model (QKV bias, MRoPE in sections)."""
        return build_stage(
            arch, configs.language, lambda: VisionTower(configs.vision, configs.projector, arch.vision),
            pre_process=pre_process, post_process=post_process, use_te=use_te, vp_stage=vp_stage,
        )  # fmt: skip

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
