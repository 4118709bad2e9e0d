"""Qwen3-VL dense (transformers' ``Qwen3VLForConditionalGeneration``) on megatron-core."""

from mmpack.trainer.models.qwen3_vl.config import MODEL_TYPE, Qwen3VLArch, arch_from_hf_config
from mmpack.trainer.models.qwen3_vl.family import FAMILY, Qwen3VLFamily

__all__ = ["FAMILY", "MODEL_TYPE", "Qwen3VLArch", "Qwen3VLFamily", "arch_from_hf_config"]
