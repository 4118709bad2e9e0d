"""The tensors a HuggingFace Qwen2.5-VL checkpoint holds for its ``config.json``: every one ``save_pretrained``
writes, by name and shape (the table :mod:`mmpack.trainer.models.hf_check` checks the files against)."""

from __future__ import annotations

from mmpack.trainer.models.qwen2_5_vl.config import Qwen25VLArch


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


def hf_tensor_shapes(arch: Qwen25VLArch) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor ``save_pretrained`` writes for this architecture."""
    return _language_shapes(arch) | _vision_shapes(arch)
