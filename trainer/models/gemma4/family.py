"""Gemma 4 (dense) behind the :class:`mmpack.trainer.models.protocol.ModelFamily` contract: the first family whose
language model is not Qwen's (see :mod:`mmpack.trainer.models.gemma4.language`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from mmpack.packing.cost import LanguageFlopShape, ModelFlopShape, VisionFlopShape
from mmpack.trainer.models.gemma4 import config as gconfig
from mmpack.trainer.models.gemma4.hf_io import Gemma4Weights
from mmpack.trainer.models.gemma4.stage import Gemma4Stage
from mmpack.trainer.models.protocol import ModelFamily, TinyModelSpec
from mmpack.trainer.models.qwen_moe import mark_expert_parameters, moe_config_fields


@dataclass(frozen=True)
class SamplePositions:
    """Gemma 4's positions (`mmpack.packing.batch.PositionRule`): each sample of a packed row counts its tokens from
    0 (padding too), in three equal rows (the trainer's [3, b, s] position layout); the stage finds its samples
    where the positions restart."""

    def positions(
        self, input_ids: np.ndarray, seq_lens: Any, image_grid_thw: np.ndarray,
        video_grid_thw: np.ndarray | None = None, second_per_grid_ts: Any = None,
    ) -> np.ndarray:  # fmt: skip
        lens = np.asarray(seq_lens, dtype=np.int64)
        if int(lens.sum()) != len(input_ids):
            raise ValueError(f"sample lengths sum to {int(lens.sum())}, the row has {len(input_ids)} tokens")
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        row = np.arange(len(input_ids), dtype=np.int64) - starts
        return np.broadcast_to(row, (3, len(row))).copy()

    def patch_positions(self, image_grid_thw: np.ndarray) -> None:
        return None


@dataclass(frozen=True)
class Gemma4Configs:
    """megatron-core configs of Gemma 4: ``language`` (the schedule's and DDP's; its ``hidden_size`` is the width
    the pipeline stages send, see :mod:`mmpack.trainer.models.gemma4.stage`) and ``vision``."""

    language: TransformerConfig
    vision: TransformerConfig


def _config(num_layers: int, hidden: int, heads: int, ffn: int, kv_channels: int, eps: float, **fields: Any):
    return TransformerConfig(
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, kv_channels=kv_channels,
        ffn_hidden_size=ffn, normalization="RMSNorm", layernorm_epsilon=eps, add_bias_linear=False,
        gated_linear_unit=True, qk_layernorm=True, **fields,
    )  # fmt: skip


def megatron_configs(
    arch: gconfig.Gemma4Arch, common: dict[str, Any], language_extra: dict[str, Any]
) -> Gemma4Configs:
    """megatron-core configs of the language model and the tower; Gemma 4 refuses what it does not run yet."""
    extra = language_extra
    t = arch.text
    if extra.get("context_parallel_size", 1) > 1:
        raise ValueError(
            "Gemma 4 does not run under context parallelism yet (its sliding-window and image masks are made "
            "per sample on one rank): give --context-parallel-size 1"
        )
    moe_fields: dict[str, Any] = {}
    if t.moe is not None:
        dispatcher = extra.get("moe_token_dispatcher_type") or "allgather"
        moe_fields = moe_config_fields(t.moe, dispatcher) | {
            "activation_func": partial(F.gelu, approximate="tanh"),
            "moe_router_load_balancing_type": "none",
            "expert_model_parallel_size": extra.get("expert_model_parallel_size", 1),
            "expert_tensor_parallel_size": extra.get("expert_tensor_parallel_size"),
        }
    if extra.get("virtual_pipeline_model_parallel_size"):
        raise ValueError(
            "Gemma 4 does not run under the interleaved pipeline yet: drop --num-layers-per-virtual-stage"
        )
    width = t.hidden_size
    if t.hidden_size_per_layer_input and common.get("pipeline_model_parallel_size", 1) > 1:
        width += t.num_layers * t.hidden_size_per_layer_input
    keep = {k: extra[k] for k in (
        "sequence_parallel", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
        "pipeline_model_parallel_layout",
    ) if k in extra}  # fmt: skip
    language = _config(
        t.num_layers,
        width,
        t.num_attention_heads,
        t.intermediate_size,
        t.head_dim,
        t.rms_norm_eps,
        **common,
        **keep,
        **moe_fields,
    )
    from mmpack.trainer.models.gemma4.vision import vision_tower_config

    return Gemma4Configs(language=language, vision=vision_tower_config(arch, common))


def tiny_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """A ``config.json`` dict of a small random Gemma 4 (alternating sliding / full layers, the last full layer of
    the sizes asked)."""
    layers = spec.num_layers
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    types[-1] = "full_attention"
    head = spec.hidden_size // spec.num_attention_heads
    text = {
        "model_type": "gemma4_text", "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size or 4 * spec.hidden_size, "num_hidden_layers": layers,
        "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": head, "global_head_dim": head, "layer_types": types, "sliding_window": 512,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0,
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": spec.vocab_size,
        "num_kv_shared_layers": 0, "attention_k_eq_v": False, "use_double_wide_mlp": False,
        "use_bidirectional_attention": "vision", "tie_word_embeddings": True, "pad_token_id": 0,
        "max_position_embeddings": spec.max_position_embeddings,
    }  # fmt: skip
    vision = {
        "model_type": "gemma4_vision", "hidden_size": spec.vision_hidden_size,
        "intermediate_size": 2 * spec.vision_hidden_size, "num_hidden_layers": spec.vision_depth,
        "num_attention_heads": spec.vision_num_heads, "num_key_value_heads": spec.vision_num_heads,
        "head_dim": spec.vision_hidden_size // spec.vision_num_heads, "patch_size": spec.patch_size,
        "pooling_kernel_size": spec.merge_size, "position_embedding_size": 10240, "rms_norm_eps": 1e-6,
        "standardize": False,
    }  # fmt: skip
    return {
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text,
        "vision_config": vision, "audio_config": None, "image_token_id": spec.image_token_id,
        "boi_token_id": spec.vision_start_token_id, "eoi_token_id": spec.vision_end_token_id,
        "video_token_id": spec.image_token_id, "tie_word_embeddings": True,
    }  # fmt: skip


class Gemma4Family(ModelFamily[gconfig.Gemma4Arch]):
    """transformers' ``Gemma4ForConditionalGeneration`` (dense)."""

    model_type = "gemma4"
    hf_model_types = ("gemma4",)
    video_rule = "gemma4"
    hf = Gemma4Weights()
    adapter_prefixes = ("vision.embedder.",)
    experts = False  # the MoE variant (`Gemma4MoEFamily`) claims the configs with `enable_moe_block`

    arch_from_hf_config = staticmethod(gconfig.arch_from_hf_config)
    tiny_hf_config = staticmethod(tiny_hf_config)
    megatron_configs = staticmethod(megatron_configs)

    def build_stage(
        self, arch: gconfig.Gemma4Arch, configs: Gemma4Configs, *, pre_process: bool, post_process: bool,
        use_te: bool = False, vp_stage: int | None = None,
    ) -> torch.nn.Module:  # fmt: skip
        vision = None
        if pre_process:
            from mmpack.trainer.models.gemma4.vision import Gemma4VisionTower

            vision = Gemma4VisionTower(configs.vision, arch)
        stage = Gemma4Stage(
            arch,
            configs.language,
            vision,
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
        )
        return mark_expert_parameters(stage) if arch.moe is not None else stage

    def position_rule(self, arch: gconfig.Gemma4Arch) -> SamplePositions:
        return SamplePositions()

    def flop_shape(self, arch: gconfig.Gemma4Arch) -> ModelFlopShape:
        t, v = arch.text, arch.vision
        layers = range(t.num_layers)
        return ModelFlopShape(
            language=LanguageFlopShape(
                hidden_size=t.hidden_size, num_layers=t.num_layers,
                attention_size=round(np.mean([t.num_attention_heads * t.layer_head_dim(i) for i in layers])),
                kv_size=round(np.mean([t.layer_kv_heads(i) * t.layer_head_dim(i) for i in layers])),
                ffn_hidden_size=round(np.mean([t.layer_intermediate_size(i) for i in layers])),
                vocab_size=t.vocab_size,
            ),
            vision=VisionFlopShape(
                hidden_size=v.hidden_size, num_layers=v.depth, ffn_hidden_size=v.intermediate_size,
                patch_pixels=3 * v.patch_size**2, merge_units=v.pooling_kernel_size**2, out_hidden_size=t.hidden_size,
            ),
        )  # fmt: skip

    def claims(self, hf_config: dict[str, Any]) -> bool:
        moe = bool((hf_config.get("text_config") or {}).get("enable_moe_block"))
        return hf_config.get("model_type") in self.hf_model_types and moe == self.experts

    def size_flags_of(self, arch: gconfig.Gemma4Arch) -> dict[str, float]:
        v, moe = arch.vision, arch.moe
        return {
            "num_experts": moe.num_experts if moe else 0, "moe_router_topk": moe.top_k if moe else 0,
            "moe_aux_loss_coeff": 0.0,
            "num_layers": arch.num_layers, "hidden_size": arch.hidden_size,
            "num_attention_heads": arch.num_attention_heads, "num_query_groups": arch.num_key_value_heads,
            "ffn_hidden_size": arch.intermediate_size, "vision_num_layers": v.depth,
            "vision_hidden_size": v.hidden_size, "vision_num_attention_heads": v.num_heads,
        }  # fmt: skip


class Gemma4MoEFamily(Gemma4Family):
    """Gemma 4's MoE variant (``enable_moe_block``, the 26B-A4B layout): experts beside every layer's dense MLP,
    on megatron-core's MoE layer with Gemma 4's router (:class:`mmpack.trainer.models.gemma4.language.Gemma4MoE`)."""

    model_type = "gemma4_moe"
    experts = True

    @staticmethod
    def tiny_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
        config = tiny_hf_config(spec)
        config["text_config"] |= {
            "enable_moe_block": True, "num_experts": spec.num_experts or 4, "top_k_experts": spec.moe_router_topk or 2,
            "moe_intermediate_size": (spec.ffn_hidden_size or 4 * spec.hidden_size) // 2,
        }  # fmt: skip
        return config


FAMILY = Gemma4Family()
MOE_FAMILY = Gemma4MoEFamily()
