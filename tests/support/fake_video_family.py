"""A rank entry point for tests/test_video_rule_registry.py: the trainer with the fake video rule
(`tests.support.fake_video_rule`) registered, and Qwen2.5-VL as a family whose processor follows that rule
(the trainer refuses a dataset planned by another rule than its model's processor).

Run as ``python tests/support/fake_video_family.py PRETRAIN_VLM_ARGS`` (a rank of `tests.support.trainer.train`
with ``entry=``)."""

from __future__ import annotations

import sys

from mmpack.trainer.models.qwen2_5_vl.family import Qwen25VLFamily
from tests.support.fake_video_rule import FAKE_STYLE

MODULE = "tests.support.fake_video_family"


class FakeVideoQwen25VL(Qwen25VLFamily):
    """Qwen2.5-VL, its videos planned by the fake rule."""

    video_rule = FAKE_STYLE


FAMILY = FakeVideoQwen25VL()


def main(argv: list[str]) -> int:
    """The trainer with the fake rule and this family registered (the two registry lines a new rule needs)."""
    from mmpack.packing import video_rules
    from mmpack.trainer import models
    from mmpack.trainer.pretrain_vlm import main as pretrain_vlm
    from tests.support import fake_video_rule

    fake_video_rule.register(video_rules.VIDEO_RULES)
    models.FAMILIES[FAMILY.model_type] = MODULE
    return pretrain_vlm(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
