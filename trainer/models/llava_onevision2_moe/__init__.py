"""LLaVA-OneVision-2 MoE (``LlavaOnevision2MoeForConditionalGeneration``: the OneVision-Encoder and a Qwen3-MoE
text model) on megatron-core, with expert parallelism."""

from mmpack.trainer.models.llava_onevision2_moe.config import (
    MODEL_TYPE,
    OneVision2MoeArch,
    arch_from_hf_config,
)
from mmpack.trainer.models.llava_onevision2_moe.family import FAMILY, OneVision2MoeFamily

__all__ = ["FAMILY", "MODEL_TYPE", "OneVision2MoeArch", "OneVision2MoeFamily", "arch_from_hf_config"]
