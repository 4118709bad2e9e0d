"""The HF state-dict adapter of LLaVA-OneVision-2: its weight rules (reading, cutting and merging is
:mod:`mmpack.trainer.models.hf_weights`). HF names are those ``LlavaOnevision2ForConditionalGeneration`` writes
with ``save_pretrained`` (``model.visual.*``, ``model.language_model.*``, ``lm_head``)."""

from __future__ import annotations

from mmpack.trainer.models.hf_weights import Rule, mlp_rules, vision_layer_rules
from mmpack.trainer.models.llava_onevision2.config import OneVision2Arch
from mmpack.trainer.models.protocol import HFAdapter
from mmpack.trainer.models.qwen_lm import language_rules

LANGUAGE = "model.language_model."
VISUAL = "model.visual."


def _vision_rules(arch: OneVision2Arch) -> dict[str, Rule]:
    v = arch.vision
    rules = {"vision.patch_embed.weight": Rule("copy", (VISUAL + "embeddings.patch_embedding.weight",), None)}
    for p in ("weight", "bias"):
        rules[f"vision.pre_layernorm.{p}"] = Rule("copy", (f"{VISUAL}layernorm_pre.{p}",), None)
        rules[f"vision.merger.norm.{p}"] = Rule("copy", (f"{VISUAL}merger.ln_q.{p}",), None)
    attn = dict(heads=v.num_heads, groups=v.num_heads, head_dim=v.head_dim)
    for i in range(v.depth):
        rules |= vision_layer_rules(
            f"vision.layers.{i}.", f"{VISUAL}encoder.layers.{i}.", attn, qkv="self_attn.qkv",
            proj="self_attn.proj", fc1="mlp.fc1", fc2="mlp.fc2", norms=("layer_norm1", "layer_norm2"),
        )  # fmt: skip
    return rules | mlp_rules(
        "vision.merger.projector.encoder.", VISUAL + "merger.mlp.0", VISUAL + "merger.mlp.2"
    )


class OneVision2Weights(HFAdapter[OneVision2Arch]):
    """LLaVA-OneVision-2's HF state-dict adapter (see the module docstring); with ``arch.moe``, its MoE variant's."""

    def part_rules(
        self, arch: OneVision2Arch, *, first: bool, last: bool, layers: tuple[int, int]
    ) -> dict[str, Rule]:
        rules = _vision_rules(arch) if first else {}
        return rules | language_rules(
            arch, first=first, last=last, layers=layers, prefix=LANGUAGE, qkv_bias=False, qk_norm=True
        )
