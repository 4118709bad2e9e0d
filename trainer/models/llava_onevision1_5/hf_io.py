"""The HF weight rules of LLaVA-OneVision-1.5 (its part of the state-dict adapter; reading, cutting and
merging is :mod:`mmpack.trainer.models.hf_weights`). HF names are those of LLaVA-OneVision-1.5's checkpoints:
``visual.*`` (the RICE-ViT and its merger), ``model.*`` (the Qwen3 text model), ``lm_head``."""

from __future__ import annotations

from mmpack.trainer.models.hf_weights import Rule, mlp_rules, output_rules, vision_layer_rules
from mmpack.trainer.models.llava_onevision1_5.config import OneVision15Arch
from mmpack.trainer.models.qwen_lm import decoder_rules
from mmpack.trainer.models.qwen_moe import MoEArch

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


def part_rules(
    arch: OneVision15Arch, *, first: bool, last: bool, layers: tuple[int, int], moe: MoEArch | None = None
) -> dict[str, Rule]:
    """The rules of a consecutive part of the model: ``first`` (vision tower and embedding), the language
    ``layers`` (first global layer, count), ``last`` (final norm and output layer); ``moe``: the language
    layers' MLPs are that mixture of experts (the MoE variant)."""
    rules = _vision_rules(arch) if first else {}
    rules |= decoder_rules(
        arch, *layers, hf_layers=LANGUAGE + "layers.", qkv_bias=False, qk_norm=True, moe=moe
    )
    return rules | output_rules(
        first=first, last=last, tied=arch.tie_word_embeddings, norm=LANGUAGE + "norm.weight",
        embedding=LANGUAGE + "embed_tokens.weight",
    )  # fmt: skip
