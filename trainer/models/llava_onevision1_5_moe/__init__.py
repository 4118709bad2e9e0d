"""LLaVA-OneVision-1.5 MoE (``LLaVAOneVision1_5_ForConditionalGeneration``: the RICE-ViT and a Qwen3-MoE text
model, as in its 30B-A3B) on megatron-core, with expert parallelism."""

from mmpack.trainer.models.llava_onevision1_5_moe.config import (
    MODEL_TYPE,
    OneVision15MoeArch,
    arch_from_hf_config,
)
from mmpack.trainer.models.llava_onevision1_5_moe.family import FAMILY, OneVision15MoeFamily

__all__ = ["FAMILY", "MODEL_TYPE", "OneVision15MoeArch", "OneVision15MoeFamily", "arch_from_hf_config"]
