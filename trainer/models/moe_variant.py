"""A dense family's mixture-of-experts variant, made by one factory (:func:`with_experts`): the same model with
``text_config``'s experts (:mod:`mmpack.trainer.models.qwen_moe`) as every language layer's MLP.

Only reading and writing ``config.json`` is the variant's own (:class:`ExpertsFormat`: how the family's files
hold the experts). Everything else is the dense family's, because the experts travel on the architecture
(``arch.moe``): the language model's megatron-core config, its HF rules, the stage's expert-parallel
parameters, the size flags and the FLOP shape read them there.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from mmpack.packing.batch import PositionRule
from mmpack.packing.cost import ModelFlopShape
from mmpack.trainer.models.protocol import ArchT, FamilyConfigs, ModelFamily, TinyModelSpec
from mmpack.trainer.models.qwen_lm import expect_model_type, refuse_value
from mmpack.trainer.models.qwen_moe import moe_arch_from_text, text_has_experts, tiny_moe_text_fields


@dataclass(kw_only=True, frozen=True)
class ExpertsFormat:
    """How a family's ``config.json`` holds the experts of its MoE variant."""

    model_type: str  # the variant's name (registry key, --model-type)
    # the config.json model_types it reads (the dense family's: only with a mixture-of-experts text model)
    hf_model_types: tuple[str, ...]
    text_model_types: tuple[str, ...] = ()  # text_config model_types it takes (absent: the first); (): any
    dense_text_model_type: str | None = None  # the text_config model_type the dense family reads (None: same)
    norm_topk_prob: bool | None = None  # fixed by the model (the file's when None)
    per_expert_files: bool = False  # each expert's own HF tensors (Qwen3-MoE's layout), else stacked
    # a small random config.json: the dense one's with these top-level fields and text_config / vision_config
    # fields (and the experts' in text_config; ``aux_loss_at_top``: their router_aux_loss_coef at the top too)
    tiny_fields: dict[str, Any] = field(default_factory=dict)
    tiny_text_fields: dict[str, Any] = field(default_factory=dict)
    tiny_vision_fields: dict[str, Any] = field(default_factory=dict)
    aux_loss_at_top: bool = False


class ExpertsVariant(ModelFamily[ArchT]):
    """``dense`` with the experts of :class:`ExpertsFormat` ``format`` (see the module docstring)."""

    def __init__(self, dense: ModelFamily[ArchT], format: ExpertsFormat) -> None:
        self.dense, self.format = dense, format
        self.model_type = format.model_type
        self.hf_model_types = format.hf_model_types
        self.video_rule = dense.video_rule
        self.hf = dense.hf  # its rules read arch.moe
        self.adapter_prefixes = dense.adapter_prefixes

    def claims(self, hf_config: dict[str, Any]) -> bool:
        """Its own ``model_type``, or one of its others (the dense family's) with a mixture-of-experts text."""
        model_type = hf_config.get("model_type")
        return model_type == self.model_type or (super().claims(hf_config) and text_has_experts(hf_config))

    def arch_from_hf_config(self, cfg: dict[str, Any]) -> ArchT:
        """The dense family's reading of the attention, norms and vision tower, with the experts."""
        f = self.format
        expect_model_type(cfg, *f.hf_model_types)
        text = cfg.get("text_config") or {}
        if f.text_model_types:
            refuse_value(text, "text_config", "model_type", f.text_model_types)
        moe = dataclasses.replace(
            moe_arch_from_text(text, norm_topk_prob=f.norm_topk_prob), per_expert_files=f.per_expert_files
        )
        if f.dense_text_model_type is not None:
            text = {**text, "model_type": f.dense_text_model_type}
        dense_cfg = {**cfg, "model_type": self.dense.hf_model_types[0], "text_config": text}
        return dataclasses.replace(self.dense.arch_from_hf_config(dense_cfg), moe=moe, source=cfg)  # type: ignore[type-var]

    def tiny_hf_config(self, spec: TinyModelSpec) -> dict[str, Any]:
        """The dense family's with 4 experts of 2 per token unless ``spec`` says (each expert as wide as the
        hidden size unless ``spec.ffn_hidden_size``)."""
        f = self.format
        config = self.dense.tiny_hf_config(spec)
        experts = tiny_moe_text_fields(
            spec.num_experts, spec.moe_router_topk, spec.moe_aux_loss_coeff, spec.hidden_size, spec.ffn_hidden_size
        )  # fmt: skip
        config |= {
            **copy.deepcopy(f.tiny_fields),
            "text_config": {**config["text_config"], **f.tiny_text_fields, **experts},
            "vision_config": {**config["vision_config"], **f.tiny_vision_fields},
        }
        if f.aux_loss_at_top:
            config["router_aux_loss_coef"] = experts["router_aux_loss_coef"]
        return config

    def megatron_configs(
        self, arch: ArchT, common: dict[str, Any], language_extra: dict[str, Any]
    ) -> FamilyConfigs:
        return self.dense.megatron_configs(arch, common, language_extra)

    def build_stage(
        self, arch: ArchT, configs: Any, *, pre_process: bool, post_process: bool, use_te: bool = False,
        vp_stage: int | None = None,
    ) -> torch.nn.Module:  # fmt: skip
        return self.dense.build_stage(
            arch, configs, pre_process=pre_process, post_process=post_process, use_te=use_te,
            vp_stage=vp_stage,
        )  # fmt: skip

    def position_rule(self, arch: ArchT) -> PositionRule:
        return self.dense.position_rule(arch)

    def flop_shape(self, arch: ArchT) -> ModelFlopShape:
        return self.dense.flop_shape(arch)


def with_experts(dense: ModelFamily[ArchT], format: ExpertsFormat) -> ModelFamily[ArchT]:
    """The mixture-of-experts variant of the family ``dense`` whose files hold the experts as ``format`` says."""
    return ExpertsVariant(dense, format)
