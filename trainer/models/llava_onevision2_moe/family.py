"""LLaVA-OneVision-2 MoE behind the :class:`mmpack.trainer.models.protocol.ModelFamily` contract: the dense
family with the experts in its language layers, their HF weight rules, size flags and FLOPs."""

from __future__ import annotations

from typing import Any

from mmpack.packing.cost import ModelFlopShape
from mmpack.trainer.models.hf_weights import Rule
from mmpack.trainer.models.llava_onevision2 import hf_io
from mmpack.trainer.models.llava_onevision2.family import OneVision2Family
from mmpack.trainer.models.llava_onevision2_moe import config
from mmpack.trainer.models.qwen_moe import mark_expert_parameters, moe_flop_shape, moe_size_flags


def part_rules(
    arch: config.OneVision2MoeArch, *, first: bool, last: bool, layers: tuple[int, int]
) -> dict[str, Rule]:
    """The dense family's rules, each language layer's MLP its router and experts."""
    return hf_io.part_rules(arch, first=first, last=last, layers=layers, moe=arch.moe)


class OneVision2MoeFamily(OneVision2Family):
    """``LlavaOnevision2MoeForConditionalGeneration`` with a Qwen3-MoE text model."""

    model_type = config.MODEL_TYPE

    arch_from_hf_config = staticmethod(config.arch_from_hf_config)
    megatron_configs = staticmethod(config.build_transformer_configs)  # type: ignore[assignment]  # its arch
    part_rules = staticmethod(part_rules)  # type: ignore[assignment]  # the experts come from the arch
    tiny_hf_config = staticmethod(config.tiny_hf_config)

    def build_stage(self, arch: Any, configs: Any, **kwargs: Any) -> Any:
        """The dense family's stage; its experts are expert-parallel parameters under every EP size (see
        :func:`mmpack.trainer.models.qwen_moe.mark_expert_parameters`)."""
        return mark_expert_parameters(super().build_stage(arch, configs, **kwargs))

    def size_flags_of(self, arch: Any) -> dict[str, Any]:
        return moe_size_flags(super().size_flags_of(arch), arch.moe)

    def flop_shape(self, arch: Any) -> ModelFlopShape:
        """The dense family's, each token running its top-k experts and the router."""
        return moe_flop_shape(super().flop_shape(arch), arch.moe)


FAMILY = OneVision2MoeFamily()
