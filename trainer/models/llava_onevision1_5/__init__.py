"""LLaVA-OneVision-1.5 (``LLaVAOneVision1_5_ForConditionalGeneration``: the RICE-ViT and a Qwen3 text model)
and its MoE variant (a Qwen3-MoE text model, as in its 30B-A3B, with expert parallelism) on megatron-core."""

from mmpack.trainer.models.llava_onevision1_5.config import MODEL_TYPE, OneVision15Arch, arch_from_hf_config
from mmpack.trainer.models.llava_onevision1_5.family import FAMILY, MOE_FAMILY, OneVision15Family

__all__ = [
    "FAMILY",
    "MODEL_TYPE",
    "MOE_FAMILY",
    "OneVision15Arch",
    "OneVision15Family",
    "arch_from_hf_config",
]
