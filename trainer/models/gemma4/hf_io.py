"""The HF state-dict adapter of Gemma 4: its weight rules and tensor table (reading, cutting and merging is
:mod:`mmpack.trainer.models.hf_weights`).

HF names are those ``Gemma4ForConditionalGeneration.save_pretrained`` writes (``model.language_model.*``,
``model.vision_tower.*``, ``model.embed_vision.*``; ``lm_head`` only when the embeddings are not tied). Each
layer's ``layer_scalar`` is a buffer, not a parameter: it is read into the stage, and written back, beside the
parameters' rules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmpack.trainer.models import hf_weights
from mmpack.trainer.models.gemma4.config import Gemma4Arch
from mmpack.trainer.models.hf_weights import ExpertSlice, Rule, output_rules, strip_wrappers, unwrapped
from mmpack.trainer.models.protocol import HFAdapter
from mmpack.trainer.models.qwen_moe import moe_rules

LM = "model.language_model."


def _vision_parts(arch: Gemma4Arch) -> tuple[dict[str, Rule], dict[str, tuple[int, ...]]]:
    from mmpack.trainer.models.gemma4 import vision

    return vision.vision_rules(arch), vision.vision_shapes(arch)


def layer_rules(arch: Gemma4Arch, first: int, count: int) -> dict[str, Rule]:
    """HF rules of ``count`` decoder layers from global layer ``first``."""
    t = arch.text
    rules: dict[str, Rule] = {}
    for local in range(count):
        i = first + local
        hf, mc = f"{LM}layers.{i}.", f"language_model.decoder.layers.{local}."
        attn = mc + "self_attention."
        rules |= {
            mc + "input_layernorm.weight": Rule("copy", (hf + "input_layernorm.weight",), None),
            mc + "post_attention_layernorm.weight": Rule(
                "copy", (hf + "post_attention_layernorm.weight",), None
            ),
            mc + "pre_mlp_layernorm.weight": Rule("copy", (hf + "pre_feedforward_layernorm.weight",), None),
            mc + "post_mlp_layernorm.weight": Rule("copy", (hf + "post_feedforward_layernorm.weight",), None),
            attn + "linear_q.weight": Rule("copy", (hf + "self_attn.q_proj.weight",), 0),
            attn + "q_layernorm.weight": Rule("copy", (hf + "self_attn.q_norm.weight",), None),
            attn + "linear_proj.weight": Rule("copy", (hf + "self_attn.o_proj.weight",), 1),
        }
        dense = mc + ("mlp.dense." if t.moe is not None else "mlp.")
        rules[dense + "linear_fc1.weight"] = Rule(
            "glu", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
        )
        rules[dense + "linear_fc2.weight"] = Rule("copy", (hf + "mlp.down_proj.weight",), 1)
        if t.moe is not None:
            rules |= _moe_rules(arch, hf, mc + "mlp.")
        if t.kv_source(i) == i:
            heads = dict(groups=t.layer_kv_heads(i), head_dim=t.layer_head_dim(i))
            rules[attn + "k_layernorm.weight"] = Rule("copy", (hf + "self_attn.k_norm.weight",), None)
            rules[attn + "linear_k.weight"] = Rule("kv_heads", (hf + "self_attn.k_proj.weight",), **heads)
            if t.has_value_projection(i):
                rules[attn + "linear_v.weight"] = Rule("kv_heads", (hf + "self_attn.v_proj.weight",), **heads)
        if t.hidden_size_per_layer_input:
            rules |= {
                mc + "ple_gate.weight": Rule("copy", (hf + "per_layer_input_gate.weight",), None),
                mc + "ple_projection.weight": Rule("copy", (hf + "per_layer_projection.weight",), None),
                mc + "ple_layernorm.weight": Rule("copy", (hf + "post_per_layer_input_norm.weight",), None),
            }
    return rules


def _moe_rules(arch: Gemma4Arch, hf: str, mc: str) -> dict[str, Rule]:
    """A MoE layer's router, experts (transformers' stacked ``experts.gate_up_proj`` / ``down_proj``, megatron-core's
    local experts numbered globally) and the norms around them."""
    moe = arch.text.moe
    assert moe is not None
    rules = {
        k: v for k, v in moe_rules(moe, arch.hidden_size, hf, mc).items() if not k.endswith("router.weight")
    }
    norms = {
        "post_dense_layernorm": "post_feedforward_layernorm_1", "pre_experts_layernorm": "pre_feedforward_layernorm_2",
        "post_experts_layernorm": "post_feedforward_layernorm_2",
    }  # fmt: skip
    for ours, theirs in norms.items():
        rules[f"{mc}{ours}.weight"] = Rule("copy", (f"{hf}{theirs}.weight",), None)
    for ours, theirs in (
        ("proj.weight", "proj.weight"),
        ("scale", "scale"),
        ("per_expert_scale", "per_expert_scale"),
    ):
        rules[f"{mc}router.{ours}"] = Rule("copy", (f"{hf}router.{theirs}",), None)
    return rules


def _moe_shapes(arch: Gemma4Arch, p: str) -> dict[str, tuple[int, ...]]:
    moe, h = arch.text.moe, arch.hidden_size
    assert moe is not None
    e, i = moe.num_experts, moe.ffn_hidden_size
    norms = ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")
    return {p + n + ".weight": (h,) for n in norms} | {
        p + "router.proj.weight": (e, h), p + "router.scale": (h,), p + "router.per_expert_scale": (e,),
        p + "experts.gate_up_proj": (e, 2 * i, h), p + "experts.down_proj": (e, h, i),
    }  # fmt: skip


def _embedding_rules(arch: Gemma4Arch) -> dict[str, Rule]:
    if not arch.text.hidden_size_per_layer_input:
        return {}
    e = "language_model.embedding."
    return {
        e + "per_layer_embeddings.weight": Rule("copy", (LM + "embed_tokens_per_layer.weight",), 0),
        e + "per_layer_projection.weight": Rule("copy", (LM + "per_layer_model_projection.weight",), None),
        e + "per_layer_projection_norm.weight": Rule(
            "copy", (LM + "per_layer_projection_norm.weight",), None
        ),
    }


def _scalar_names(model: torch.nn.Module) -> dict[str, str]:
    """This stage's ``layer_scalar`` buffers: parameter-style name -> HF name."""
    layers = unwrapped(model).language_model.decoder.layers
    return {
        f"language_model.decoder.layers.{local}.layer_scalar": f"{LM}layers.{layer.layer}.layer_scalar"
        for local, layer in enumerate(layers)
    }


class Gemma4Weights(HFAdapter[Gemma4Arch]):
    """Gemma 4's HF state-dict adapter (see the module docstring)."""

    def part_rules(
        self, arch: Gemma4Arch, *, first: bool, last: bool, layers: tuple[int, int]
    ) -> dict[str, Rule]:
        rules = layer_rules(arch, *layers)
        if first:
            rules |= _vision_parts(arch)[0] | _embedding_rules(arch)
        return rules | output_rules(
            first=first, last=last, tied=arch.tie_word_embeddings, norm=LM + "norm.weight",
            embedding=LM + "embed_tokens.weight",
        )  # fmt: skip

    def tensor_shapes(self, arch: Gemma4Arch) -> dict[str, tuple[int, ...]]:
        t = arch.text
        h = t.hidden_size
        shapes: dict[str, tuple[int, ...]] = {
            LM + "embed_tokens.weight": (t.vocab_size, h),
            LM + "norm.weight": (h,),
        }
        if not t.tie_word_embeddings:
            shapes["lm_head.weight"] = (t.vocab_size, h)
        ple = t.hidden_size_per_layer_input
        if ple:
            shapes |= {
                LM + "embed_tokens_per_layer.weight": (t.vocab_size_per_layer_input, t.num_layers * ple),
                LM + "per_layer_model_projection.weight": (t.num_layers * ple, h),
                LM + "per_layer_projection_norm.weight": (ple,),
            }
        for i in range(t.num_layers):
            p, d = f"{LM}layers.{i}.", t.layer_head_dim(i)
            q, kv, ffn = t.num_attention_heads * d, t.layer_kv_heads(i) * d, t.layer_intermediate_size(i)
            shapes |= {p + n: (h,) for n in (
                "input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
                "post_feedforward_layernorm.weight",
            )}  # fmt: skip
            shapes |= {
                p + "layer_scalar": (1,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (ffn, h),
                p + "mlp.up_proj.weight": (ffn, h),
                p + "mlp.down_proj.weight": (h, ffn),
            }
            if t.moe is not None:
                shapes |= _moe_shapes(arch, p)
            if t.kv_source(i) == i:
                shapes |= {p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_norm.weight": (d,)}
                if t.has_value_projection(i):
                    shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            if ple:
                shapes |= {
                    p + "per_layer_input_gate.weight": (ple, h),
                    p + "per_layer_projection.weight": (h, ple),
                    p + "post_per_layer_input_norm.weight": (h,),
                }
        return shapes | _vision_parts(arch)[1]

    def load_stage_weights(
        self, model: torch.nn.Module, model_dir: str | Path, arch: Gemma4Arch, *, tp_rank: int, tp_size: int,
        experts: ExpertSlice | None = None,
    ) -> int:  # fmt: skip
        read = super().load_stage_weights(
            model, model_dir, arch, tp_rank=tp_rank, tp_size=tp_size, experts=experts
        )
        buffers, scalars = dict(unwrapped(model).named_buffers()), _scalar_names(model)
        with hf_weights.open_hf_weights(model_dir) as reader, torch.no_grad():
            for ours, hf in scalars.items():
                buffers[ours].copy_(reader.read(hf).to(buffers[ours].dtype))
        return read + len(scalars)

    def stage_state_dict(
        self,
        model_dir: str | Path,
        arch: Gemma4Arch,
        *,
        tp_rank: int,
        tp_size: int,
        pp_rank: int,
        pp_size: int,
    ) -> dict[str, torch.Tensor]:
        out = super().stage_state_dict(
            model_dir, arch, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size
        )
        first, count = hf_weights.layers_of_stage(arch.num_layers, pp_rank, pp_size)
        with hf_weights.open_hf_weights(model_dir) as reader:
            for local in range(count):
                name = f"language_model.decoder.layers.{local}.layer_scalar"
                out[name] = reader.read(f"{LM}layers.{first + local}.layer_scalar").contiguous()
        return out

    def hf_state_dict(
        self, arch: Gemma4Arch, shards: dict[tuple[int, int], dict[str, Any]], tp_size: int, pp_size: int
    ) -> dict[str, torch.Tensor]:
        out = super().hf_state_dict(arch, shards, tp_size, pp_size)
        for pp in range(pp_size):
            first, count = hf_weights.layers_of_stage(arch.num_layers, pp, pp_size)
            state = {strip_wrappers(k): v for k, v in shards[(0, pp)].items()}
            for local in range(count):
                name = f"language_model.decoder.layers.{local}.layer_scalar"
                if name not in state:
                    raise ValueError(f"checkpoint stage {pp} has no {name}")
                out[f"{LM}layers.{first + local}.layer_scalar"] = torch.as_tensor(state[name]).contiguous()
        return out
