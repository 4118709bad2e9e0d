"""The HF state-dict adapter of LLaVA-OneVision-1.5: its weight rules (reading, cutting and merging is
:mod:`mmpack.trainer.models.hf_weights`). HF names are those of LLaVA-OneVision-1.5's checkpoints:
``visual.*`` (the RICE-ViT and its merger), ``model.*`` (the Qwen3 text model), ``lm_head``."""

from __future__ import annotations

from mmpack.trainer.models.hf_weights import Rule, mlp_rules, vision_layer_rules
from mmpack.trainer.models.llava_onevision1_5.config import OneVision15Arch
from mmpack.trainer.models.protocol import HFAdapter
from mmpack.trainer.models.qwen_lm import language_rules

LANGUAGE = "model."
VISUAL = "visual."


def _vision_rules(arch: OneVision15Arch) -> dict[str, Rule]:
    v = arch.vision
    rules = {
        "vision.patch_embed.weight": Rule("copy", (VISUAL + "patch_embed.proj.weight",), None),
        "vision.class_token.embedding": Rule("copy", (VISUAL + "class_embedding",), None),
        "vision.class_token.angles": Rule("copy", (VISUAL + "class_pos_emb",), None),
    }
    for p in ("weight", "bias"):
        rules[f"vision.pre_layernorm.{p}"] = Rule("copy", (f"{VISUAL}pre_layernorm.{p}",), None)
        rules[f"vision.merger.norm.{p}"] = Rule("copy", (f"{VISUAL}merger.ln_q.{p}",), None)
    attn = dict(heads=v.num_heads, groups=v.num_heads, head_dim=v.head_dim)
    for i in range(v.depth):
        rules |= vision_layer_rules(
            f"vision.layers.{i}.", f"{VISUAL}blocks.{i}.", attn, qkv="attn.qkv", proj="attn.proj", fc1="mlp.fc1",
            fc2="mlp.fc2", norms=("norm1", "norm2"),
        )  # fmt: skip
    return rules | mlp_rules(
        "vision.merger.projector.encoder.", VISUAL + "merger.mlp.0", VISUAL + "merger.mlp.2"
    )


class OneVision15Weights(HFAdapter[OneVision15Arch]):
    """LLaVA-OneVision-1.5's HF state-dict adapter (see the module docstring); with ``arch.moe``, its MoE variant's."""

    def part_rules(
        self, arch: OneVision15Arch, *, first: bool, last: bool, layers: tuple[int, int]
    ) -> dict[str, Rule]:
        rules = _vision_rules(arch) if first else {}
        return rules | language_rules(
            arch, first=first, last=last, layers=layers, prefix=LANGUAGE, qkv_bias=False, qk_norm=True
        )
