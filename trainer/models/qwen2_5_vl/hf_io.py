"""The HF weight rules of Qwen2.5-VL (its part of the state-dict adapter; reading, cutting and merging is
:mod:`mmpack.trainer.models.hf_weights`).

HF names are those transformers writes with ``save_pretrained`` (``model.layers.*``, ``visual.*``,
``lm_head``); files with the ``model.language_model.*`` / ``model.visual.*`` layout are read as well.
"""

from __future__ import annotations

from mmpack.trainer.models import hf_weights
from mmpack.trainer.models.hf_weights import Rule, mlp_rules, output_rules
from mmpack.trainer.models.qwen2_5_vl.config import Qwen25VLArch
from mmpack.trainer.models.qwen_lm import decoder_rules


def _vision_rules(arch: Qwen25VLArch) -> dict[str, Rule]:
    v = arch.vision
    rules = {"vision.patch_embed.weight": Rule("copy", ("visual.patch_embed.proj.weight",), None)}
    attn = dict(heads=v.num_heads, groups=v.num_heads, head_dim=v.head_dim)
    for i in range(v.depth):
        hf, mc = f"visual.blocks.{i}.", f"vision.layers.{i}."
        rules |= {
            mc + "input_layernorm.weight": Rule("copy", (hf + "norm1.weight",), None),
            mc + "self_attention.linear_qkv.weight": Rule("fused_qkv", (hf + "attn.qkv.weight",), **attn),
            mc + "self_attention.linear_qkv.bias": Rule("fused_qkv", (hf + "attn.qkv.bias",), **attn),
            mc + "self_attention.linear_proj.weight": Rule("copy", (hf + "attn.proj.weight",), 1),
            mc + "self_attention.linear_proj.bias": Rule("copy", (hf + "attn.proj.bias",), None),
            mc + "pre_mlp_layernorm.weight": Rule("copy", (hf + "norm2.weight",), None),
            mc + "mlp.linear_fc1.weight": Rule(
                "glu", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
            ),
            mc + "mlp.linear_fc1.bias": Rule("glu", (hf + "mlp.gate_proj.bias", hf + "mlp.up_proj.bias")),
            mc + "mlp.linear_fc2.weight": Rule("copy", (hf + "mlp.down_proj.weight",), 1),
            mc + "mlp.linear_fc2.bias": Rule("copy", (hf + "mlp.down_proj.bias",), None),
        }
    enc = "vision.merger.projector.encoder."
    merger = mlp_rules(enc, "visual.merger.mlp.0", "visual.merger.mlp.2")
    return rules | {"vision.merger.ln_q.weight": Rule("copy", ("visual.merger.ln_q.weight",), None)} | merger


def part_rules(arch: Qwen25VLArch, *, first: bool, last: bool, layers: tuple[int, int]) -> dict[str, Rule]:
    """The rules of a consecutive part of the model: ``first`` (vision tower and embedding), the language
    ``layers`` (first global layer, count), ``last`` (final norm and output layer)."""
    rules = _vision_rules(arch) if first else {}
    rules |= decoder_rules(arch, *layers, hf_layers="model.layers.", qkv_bias=True, qk_norm=False)
    return rules | output_rules(
        first=first, last=last, tied=arch.tie_word_embeddings, norm="model.norm.weight",
        embedding="model.embed_tokens.weight",
    )  # fmt: skip


def stage_rules(
    arch: Qwen25VLArch, pp_rank: int, pp_size: int, layers: tuple[int, int] | None = None
) -> dict[str, Rule]:
    """megatron-core parameter name (relative to the stage's model) -> :class:`Rule` of one stage."""
    return hf_weights.stage_rules(part_rules, arch, pp_rank, pp_size, layers)
