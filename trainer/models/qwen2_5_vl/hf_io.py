"""The HF state-dict adapter of Qwen2.5-VL: its weight rules and tensor table (reading, cutting and merging is
:mod:`mmpack.trainer.models.hf_weights`).

HF names are those transformers writes with ``save_pretrained`` (``model.layers.*``, ``visual.*``,
``lm_head``); files with the ``model.language_model.*`` / ``model.visual.*`` layout are read as well.
"""

from __future__ import annotations

from mmpack.trainer.models.hf_weights import Rule, mlp_rules
from mmpack.trainer.models.protocol import HFAdapter
from mmpack.trainer.models.qwen2_5_vl.config import Qwen25VLArch
from mmpack.trainer.models.qwen_lm import language_rules


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


class Qwen25VLWeights(HFAdapter[Qwen25VLArch]):
    """Qwen2.5-VL's HF state-dict adapter (see the module docstring), with the table of every tensor
    ``save_pretrained`` writes, by name and shape (:mod:`mmpack.trainer.models.hf_check` checks the files
    against it)."""

    def part_rules(
        self, arch: Qwen25VLArch, *, first: bool, last: bool, layers: tuple[int, int]
    ) -> dict[str, Rule]:
        rules = _vision_rules(arch) if first else {}
        return rules | language_rules(
            arch, first=first, last=last, layers=layers, prefix="model.", qkv_bias=True, qk_norm=False
        )

    def tensor_shapes(self, arch: Qwen25VLArch) -> dict[str, tuple[int, ...]]:
        return _language_shapes(arch) | _vision_shapes(arch)


def _language_shapes(arch: Qwen25VLArch) -> dict[str, tuple[int, ...]]:
    h, q = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    kv, ffn = arch.num_key_value_heads * arch.head_dim, arch.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ffn, h),
            p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn),
        }
    return shapes


def _vision_shapes(arch: Qwen25VLArch) -> dict[str, tuple[int, ...]]:
    v = arch.vision
    h, ffn, merged = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size**2
    patch = (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    shapes: dict[str, tuple[int, ...]] = {"visual.patch_embed.proj.weight": patch}
    for i in range(v.depth):
        p = f"visual.blocks.{i}."
        shapes |= {
            p + "norm1.weight": (h,),
            p + "norm2.weight": (h,),
            p + "attn.qkv.weight": (3 * h, h),
            p + "attn.qkv.bias": (3 * h,),
            p + "attn.proj.weight": (h, h),
            p + "attn.proj.bias": (h,),
            p + "mlp.gate_proj.weight": (ffn, h),
            p + "mlp.gate_proj.bias": (ffn,),
            p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.up_proj.bias": (ffn,),
            p + "mlp.down_proj.weight": (h, ffn),
            p + "mlp.down_proj.bias": (h,),
        }
    return shapes | {
        "visual.merger.ln_q.weight": (h,),
        "visual.merger.mlp.0.weight": (merged, merged),
        "visual.merger.mlp.0.bias": (merged,),
        "visual.merger.mlp.2.weight": (v.out_hidden_size, merged),
        "visual.merger.mlp.2.bias": (v.out_hidden_size,),
    }
