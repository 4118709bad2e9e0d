"""LLaVA-OneVision-1.5 MoE behind the :class:`mmpack.trainer.models.protocol.ModelFamily` contract: the dense
family with the experts in its language layers (:class:`mmpack.trainer.models.qwen_moe.ExpertLayers`)."""

from __future__ import annotations

from mmpack.trainer.models.llava_onevision1_5 import hf_io
from mmpack.trainer.models.llava_onevision1_5.family import OneVision15Family
from mmpack.trainer.models.llava_onevision1_5_moe import config
from mmpack.trainer.models.qwen_moe import ExpertLayers


class OneVision15MoeFamily(ExpertLayers, OneVision15Family):  # type: ignore[misc]  # part_rules: the dense one with the experts
    """``LLaVAOneVision1_5_ForConditionalGeneration`` with a Qwen3-MoE text model."""

    model_type = config.MODEL_TYPE

    arch_from_hf_config = staticmethod(config.arch_from_hf_config)
    megatron_configs = staticmethod(config.build_transformer_configs)  # type: ignore[assignment]  # its arch
    tiny_hf_config = staticmethod(config.tiny_hf_config)
    dense_part_rules = staticmethod(hf_io.part_rules)


FAMILY = OneVision15MoeFamily()
