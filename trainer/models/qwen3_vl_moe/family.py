"""Qwen3-VL-MoE behind the :class:`mmpack.trainer.models.protocol.ModelFamily` contract: Qwen3-VL's family
with the experts in its language layers (:class:`mmpack.trainer.models.qwen_moe.ExpertLayers`)."""

from __future__ import annotations

from mmpack.trainer.models.qwen3_vl import hf_io
from mmpack.trainer.models.qwen3_vl.family import Qwen3VLFamily
from mmpack.trainer.models.qwen3_vl_moe import config
from mmpack.trainer.models.qwen_moe import ExpertLayers


class Qwen3VLMoeFamily(ExpertLayers, Qwen3VLFamily):  # type: ignore[misc]  # part_rules: the dense one with the experts
    """transformers' ``Qwen3VLMoeForConditionalGeneration``."""

    model_type = config.MODEL_TYPE

    arch_from_hf_config = staticmethod(config.arch_from_hf_config)
    megatron_configs = staticmethod(config.build_transformer_configs)  # type: ignore[assignment]  # its arch
    tiny_hf_config = staticmethod(config.tiny_hf_config)
    dense_part_rules = staticmethod(hf_io.part_rules)


FAMILY = Qwen3VLMoeFamily()
