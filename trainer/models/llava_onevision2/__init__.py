"""LLaVA-OneVision-2 (``LlavaOnevision2ForConditionalGeneration``: the OneVision-Encoder and a Qwen3 text
model) and its MoE variant (a Qwen3-MoE text model, with expert parallelism) on megatron-core."""

from mmpack.trainer.models.llava_onevision2.config import MODEL_TYPE, OneVision2Arch, arch_from_hf_config
from mmpack.trainer.models.llava_onevision2.family import FAMILY, MOE_FAMILY, OneVision2Family

__all__ = ["FAMILY", "MODEL_TYPE", "MOE_FAMILY", "OneVision2Arch", "OneVision2Family", "arch_from_hf_config"]
