"""The HF state-dict adapter of Qwen3-VL: its weight rules (reading, cutting and merging is
:mod:`mmpack.trainer.models.hf_weights`). HF names are those transformers 5 writes with ``save_pretrained``
(``model.language_model.*``, ``model.visual.*``, ``lm_head``), as Qwen's own checkpoints name them."""

from __future__ import annotations

from mmpack.trainer.models.hf_weights import Rule, mlp_rules
from mmpack.trainer.models.protocol import HFAdapter
from mmpack.trainer.models.qwen3_vl.config import Qwen3VLArch
from mmpack.trainer.models.qwen_lm import language_rules

LANGUAGE = "model.language_model."
VISUAL = "model.visual."


def _merger_rules(mc: str, hf: str) -> dict[str, Rule]:
    return {
        mc + "norm.weight": Rule("copy", (hf + "norm.weight",), None),
        mc + "norm.bias": Rule("copy", (hf + "norm.bias",), None),
    } | mlp_rules(mc + "projector.encoder.", hf + "linear_fc1", hf + "linear_fc2")


def _vision_rules(arch: Qwen3VLArch) -> dict[str, Rule]:
    v = arch.vision
    rules = {
        "vision.patch_embed.weight": Rule("copy", (VISUAL + "patch_embed.proj.weight",), None),
        "vision.patch_embed.bias": Rule("copy", (VISUAL + "patch_embed.proj.bias",), None),
        "vision.pos_embed.weight": Rule("copy", (VISUAL + "pos_embed.weight",), None),
    }
    attn = dict(heads=v.num_heads, groups=v.num_heads, head_dim=v.head_dim)
    for i in range(v.depth):
        hf, mc = f"{VISUAL}blocks.{i}.", f"vision.layers.{i}."
        for norm, ours in (("norm1", "input_layernorm"), ("norm2", "pre_mlp_layernorm")):
            for p in ("weight", "bias"):
                rules[f"{mc}{ours}.{p}"] = Rule("copy", (f"{hf}{norm}.{p}",), None)
        rules |= {
            mc + "self_attention.linear_qkv.weight": Rule("fused_qkv", (hf + "attn.qkv.weight",), **attn),
            mc + "self_attention.linear_qkv.bias": Rule("fused_qkv", (hf + "attn.qkv.bias",), **attn),
            mc + "self_attention.linear_proj.weight": Rule("copy", (hf + "attn.proj.weight",), 1),
            mc + "self_attention.linear_proj.bias": Rule("copy", (hf + "attn.proj.bias",), None),
            mc + "mlp.linear_fc1.weight": Rule("copy", (hf + "mlp.linear_fc1.weight",), 0),
            mc + "mlp.linear_fc1.bias": Rule("copy", (hf + "mlp.linear_fc1.bias",), 0),
            mc + "mlp.linear_fc2.weight": Rule("copy", (hf + "mlp.linear_fc2.weight",), 1),
            mc + "mlp.linear_fc2.bias": Rule("copy", (hf + "mlp.linear_fc2.bias",), None),
        }
    rules |= _merger_rules("vision.merger.", VISUAL + "merger.")
    for k in range(len(v.deepstack_visual_indexes)):
        rules |= _merger_rules(f"vision.deepstack_mergers.{k}.", f"{VISUAL}deepstack_merger_list.{k}.")
    return rules


class Qwen3VLWeights(HFAdapter[Qwen3VLArch]):
    """Qwen3-VL's HF state-dict adapter (see the module docstring); with ``arch.moe``, Qwen3-VL-MoE's."""

    def part_rules(
        self, arch: Qwen3VLArch, *, first: bool, last: bool, layers: tuple[int, int]
    ) -> dict[str, Rule]:
        rules = _vision_rules(arch) if first else {}
        return rules | language_rules(
            arch, first=first, last=last, layers=layers, prefix=LANGUAGE, qkv_bias=False, qk_norm=True
        )
