"""A model family no trainer module knows: ``fake_vl``, written against the family protocol alone and put
together from Qwen2.5-VL's public pieces (its vision tower, language model, HF rules and FLOP shape) under its
own ``model_type``, arch class and ``architectures`` name. Registering it is one registry line
(:func:`register`). Run as ``python tests/support/fake_family.py PRETRAIN_VLM_ARGS`` it is the trainer with the
family registered (a rank's entry point)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from mmpack.packing.batch import PositionRule
from mmpack.packing.cost import ModelFlopShape
from mmpack.trainer.models.protocol import FamilyConfigs, HFAdapter, ModelFamily, TinyModelSpec
from mmpack.trainer.models.qwen2_5_vl import FAMILY as QWEN2_5_VL
from mmpack.trainer.models.qwen2_5_vl.config import Qwen25VLArch
from mmpack.trainer.models.qwen2_5_vl.vision import VisionTower
from mmpack.trainer.models.vlm_stage import build_stage

MODEL_TYPE = "fake_vl"
MODULE = "tests.support.fake_family"


@dataclasses.dataclass(kw_only=True, frozen=True)
class FakeVLArch(Qwen25VLArch):
    """The fake family's own arch class (Qwen2.5-VL's fields)."""


class FakeVLWeights(HFAdapter[FakeVLArch]):
    """Its HF names are Qwen2.5-VL's."""

    def part_rules(self, arch: FakeVLArch, *, first: bool, last: bool, layers: tuple[int, int]) -> dict:
        return QWEN2_5_VL.hf.part_rules(arch, first=first, last=last, layers=layers)


class FakeVLFamily(ModelFamily[FakeVLArch]):
    """``FakeVLForConditionalGeneration``: Qwen2.5-VL's blocks under another name."""

    model_type = MODEL_TYPE
    hf_model_types = (MODEL_TYPE,)
    video_rule = "qwen-vl-utils"
    hf = FakeVLWeights()

    def arch_from_hf_config(self, cfg: dict[str, Any]) -> FakeVLArch:
        if cfg.get("model_type") != MODEL_TYPE:
            raise ValueError(f"model_type is {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}")
        read = QWEN2_5_VL.arch_from_hf_config({**cfg, "model_type": QWEN2_5_VL.model_type})
        fields = {f.name: getattr(read, f.name) for f in dataclasses.fields(read)}
        return FakeVLArch(**{**fields, "source": cfg})

    def tiny_hf_config(self, spec: TinyModelSpec) -> dict[str, Any]:
        config = QWEN2_5_VL.tiny_hf_config(spec)
        return {**config, "architectures": ["FakeVLForConditionalGeneration"], "model_type": MODEL_TYPE}

    def megatron_configs(
        self, arch: FakeVLArch, common: dict[str, Any], language_extra: dict[str, Any]
    ) -> FamilyConfigs:
        return QWEN2_5_VL.megatron_configs(arch, common, language_extra)

    def build_stage(
        self, arch: FakeVLArch, configs: Any, *, pre_process: bool, post_process: bool, use_te: bool = False,
        vp_stage: int | None = None,
    ) -> torch.nn.Module:  # fmt: skip
        return build_stage(
            arch, configs.language, lambda: VisionTower(configs.vision, configs.projector, arch.vision),
            pre_process=pre_process, post_process=post_process, use_te=use_te, vp_stage=vp_stage,
        )  # fmt: skip

    def position_rule(self, arch: FakeVLArch) -> PositionRule:
        return QWEN2_5_VL.position_rule(arch)

    def flop_shape(self, arch: FakeVLArch) -> ModelFlopShape:
        return QWEN2_5_VL.flop_shape(arch)


FAMILY = FakeVLFamily()


def register(families: dict[str, str]) -> None:
    """The one line that adds the family: its entry in ``families`` (the registry's ``FAMILIES``)."""
    families[MODEL_TYPE] = MODULE


def main(argv: list[str]) -> int:
    """The trainer with this family registered (a rank of `tests.support.trainer.train` with ``entry=``)."""
    from mmpack.trainer import models
    from mmpack.trainer.pretrain_vlm import main as pretrain_vlm

    register(models.FAMILIES)
    return pretrain_vlm(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
