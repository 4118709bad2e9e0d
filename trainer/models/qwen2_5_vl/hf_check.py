"""What a HuggingFace Qwen2.5-VL checkpoint must hold to be this ``config.json``'s model: every tensor
``save_pretrained`` writes for it, by name and shape, in a float dtype, and nothing else. Integer or
quantized weights would be cast into nonsense, and a config.json with fewer layers than the files would load
part of the model without a word."""

from __future__ import annotations

from typing import Any

from mmpack.trainer.models.qwen2_5_vl.config import Qwen25VLArch

# Float formats the weights are read from (and cast to the run's dtype).
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
# Tensors some checkpoints carry that the model computes itself.
_IGNORED_SUFFIXES = (".inv_freq",)


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


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def check_weight_files(reader: Any, arch: Qwen25VLArch) -> None:
    """``reader`` (a ``SafetensorsReader``) holds exactly the tensors ``config.json`` describes, with their
    shapes, all of float dtypes; ValueError in one line naming the first that is not."""
    dtypes: dict[str, str] = reader.dtypes()
    for name, dtype in sorted(dtypes.items()):
        if dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{reader.root}: tensor {name} is {dtype}, not a float ({', '.join(FLOAT_DTYPES)}): quantized "
                "or integer weights cannot be trained from; give the unquantized checkpoint"
            )
    expected = hf_tensor_shapes(arch)
    tolerated = {"lm_head.weight"} if arch.tie_word_embeddings else set()  # a copy of the tied embedding
    extra = sorted(n for n in set(dtypes) - set(expected) - tolerated if not n.endswith(_IGNORED_SUFFIXES))
    missing = sorted(set(expected) - set(dtypes))
    described = f"config.json ({arch.num_layers} language layers, {arch.vision.depth} vision blocks)"
    if extra or missing:
        what = [f"{len(extra)} tensors it does not describe ({_some(extra)})"] if extra else []
        what += [f"no {_some(missing)} ({len(missing)} missing)"] if missing else []
        raise ValueError(
            f"{reader.root}: {described} and the weights disagree: the files hold {' and '.join(what)}; give "
            "the config.json the weights were saved with"
        )
    for name, shape in sorted(expected.items()):
        found = tuple(reader.shape(name))
        if found != shape:
            raise ValueError(
                f"{reader.root}: tensor {name} is {list(found)}, {described} gives {list(shape)}: config.json "
                "and the weights disagree; give the config.json the weights were saved with"
            )
