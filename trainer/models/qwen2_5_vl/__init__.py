"""Qwen2.5-VL (transformers' ``Qwen2_5_VLForConditionalGeneration``) on megatron-core."""

from mmpack.trainer.models.qwen2_5_vl.config import MODEL_TYPE, Qwen25VLArch, arch_from_hf_config
from mmpack.trainer.models.qwen2_5_vl.family import FAMILY, Qwen25VLFamily

__all__ = ["FAMILY", "MODEL_TYPE", "Qwen25VLArch", "Qwen25VLFamily", "arch_from_hf_config"]
