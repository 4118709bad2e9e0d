"""Qwen3-VL-MoE (transformers' ``Qwen3VLMoeForConditionalGeneration``) on megatron-core, with expert
parallelism."""

from mmpack.trainer.models.qwen3_vl_moe.config import MODEL_TYPE, Qwen3VLMoeArch, arch_from_hf_config
from mmpack.trainer.models.qwen3_vl_moe.family import FAMILY, Qwen3VLMoeFamily

__all__ = ["FAMILY", "MODEL_TYPE", "Qwen3VLMoeArch", "Qwen3VLMoeFamily", "arch_from_hf_config"]
