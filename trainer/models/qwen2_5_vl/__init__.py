"""Qwen2.5-VL (transformers' ``Qwen2_5_VLForConditionalGeneration``) on megatron-core."""

from mmpack.trainer.models.qwen2_5_vl.config import (
    MODEL_TYPE,
    Qwen25VLArch,
    arch_from_hf_config,
    build_transformer_configs,
    size_flags_of,
    tiny_hf_config,
)
from mmpack.trainer.models.qwen2_5_vl.hf_io import (
    check_hf_weights,
    hf_state_dict,
    init_stage_random,
    load_stage_weights,
    stage_rules,
    stage_state_dict,
)
from mmpack.trainer.models.qwen2_5_vl.model import Qwen25VLModel

Model = Qwen25VLModel
Arch = Qwen25VLArch

__all__ = [
    "MODEL_TYPE",
    "Arch",
    "Model",
    "arch_from_hf_config",
    "build_transformer_configs",
    "check_hf_weights",
    "hf_state_dict",
    "init_stage_random",
    "load_stage_weights",
    "size_flags_of",
    "stage_rules",
    "stage_state_dict",
    "tiny_hf_config",
]
