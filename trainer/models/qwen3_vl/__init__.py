"""Qwen3-VL (transformers' ``Qwen3VLForConditionalGeneration``) and Qwen3-VL-MoE
(``Qwen3VLMoeForConditionalGeneration``, with expert parallelism) on megatron-core."""

from mmpack.trainer.models.qwen3_vl.config import MODEL_TYPE, Qwen3VLArch, arch_from_hf_config
from mmpack.trainer.models.qwen3_vl.family import FAMILY, MOE_FAMILY, Qwen3VLFamily

__all__ = ["FAMILY", "MODEL_TYPE", "MOE_FAMILY", "Qwen3VLArch", "Qwen3VLFamily", "arch_from_hf_config"]
