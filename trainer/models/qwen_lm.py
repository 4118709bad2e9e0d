"""The Qwen language models of the vision-language families on megatron-core: Qwen2 / Qwen2.5 (QKV bias) and
Qwen3 (RMSNorm over each query and key head, no bias), as a ``GPTModel`` with multimodal RoPE.

Shared by every family whose language model is one of these (Qwen2.5-VL, Qwen3-VL, and Qwen3 text models
behind other vision towers): its megatron-core config (:func:`language_config`), the model of one pipeline
stage (:func:`build_language_model`) and the HF weight rules of its decoder layers (:func:`decoder_rules`).

MRoPE: the rotary frequencies are split among the temporal, height and width positions. Qwen2-VL and
Qwen2.5-VL give each axis a contiguous section of frequencies (megatron-core's ``MultimodalRotaryEmbedding``);
Qwen3-VL interleaves them (frequency j rotates by the height position when j % 3 == 1 and j < 3 * section_h,
by the width position when j % 3 == 2 and j < 3 * section_w, else by the temporal position), as transformers'
``Qwen3VLTextRotaryEmbedding``: :class:`InterleavedMRoPE`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build

from mmpack.packing.cost import LanguageFlopShape
from mmpack.trainer.models.common import build_block_spec
from mmpack.trainer.models.hf_weights import Rule, output_rules
from mmpack.trainer.models.qwen_moe import MoEArch, moe_config_fields, moe_rules

if TYPE_CHECKING:
    from mmpack.trainer.models.protocol import TinyModelSpec


@dataclass(kw_only=True, frozen=True)
class QwenLMArch:
    """The language model of a family's architecture, from its ``config.json`` (a family's arch adds its
    vision tower and special ids)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    moe: MoEArch | None = None  # the experts of every layer's MLP (a family's MoE variant); None: dense MLPs

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(
                f"mrope_section {self.mrope_section} must sum to head_dim / 2 = {self.head_dim // 2}"
            )
        if self.hidden_act != "silu":
            raise ValueError("only hidden_act 'silu' (SwiGLU) is supported")


@dataclass(kw_only=True, frozen=True)
class VLArch(QwenLMArch):
    """A vision-language model's architecture from its ``config.json``: the language model, the special ids,
    the vision tower (each family's own arch: a subclass narrows ``vision``) and the file it was read from."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision: Any
    source: dict[str, Any]  # the config.json it was read from, written back on export


def special_ids(cfg: dict[str, Any]) -> dict[str, Any]:
    """The :class:`VLArch` special ids of a ``config.json`` dict (Qwen2-VL's tokenizer's where it has none)."""
    return {
        "image_token_id": int(cfg.get("image_token_id", 151655)),
        "video_token_id": int(cfg.get("video_token_id", 151656)),
        "vision_start_token_id": int(cfg.get("vision_start_token_id", 151652)),
    }


def lm_fields(
    cfg: dict[str, Any], rope: tuple[float, tuple[int, int, int]], *, max_positions: int, own_head_dim: bool
) -> dict[str, Any]:
    """The :class:`QwenLMArch` fields of a ``config.json`` dict (its ``text_config``, or the top level of
    transformers 4.x files); ``rope``: (theta, mrope_section); ``max_positions``: the default context;
    ``own_head_dim``: the file may set ``head_dim`` (Qwen3), else it is hidden / heads (Qwen2)."""
    text = {**cfg, **(cfg.get("text_config") or {})}
    heads = int(text["num_attention_heads"])
    head_dim = int(text["hidden_size"]) // heads
    return dict(
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text["intermediate_size"]),
        num_layers=int(text["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or head_dim) if own_head_dim else head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=rope[0],
        mrope_section=rope[1],
        max_position_embeddings=int(text.get("max_position_embeddings", max_positions)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        hidden_act=str(text.get("hidden_act", "silu")),
    )


def expect_model_type(cfg: dict[str, Any], *expected: str) -> None:
    """ValueError unless the ``config.json`` dict's ``model_type`` is one of ``expected``."""
    if cfg.get("model_type") not in expected:
        raise ValueError(
            f"model_type is {cfg.get('model_type')!r}, expected {' or '.join(map(repr, expected))}"
        )


def refuse_value(cfg: dict[str, Any], where: str, key: str, allowed: tuple[Any, ...]) -> None:
    """ValueError naming ``where`` and ``key`` when ``cfg[key]`` (absent: ``allowed[0]``) is not in ``allowed``."""
    if cfg.get(key, allowed[0]) not in allowed:
        raise ValueError(f"{where} {key} {cfg.get(key)!r} is not supported ({', '.join(map(repr, allowed))})")


def rope_1d(text: dict[str, Any], head_dim: int) -> tuple[float, tuple[int, int, int]]:
    """(theta, mrope_section) of a text model with 1-D RoPE behind a vision tower (``rope_parameters`` of
    transformers 5, or the 4.x keys; default RoPE only): every frequency on the first axis, the loader writing
    the same 1-D positions on all three."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type", "default")) != "default":
        raise ValueError(f"text_config rope_type {params.get('rope_type')!r} is not supported (default only)")
    return float(params.get("rope_theta", text.get("rope_theta", 1000000.0))), (head_dim // 2, 0, 0)


def qwen3_text_fields(
    cfg: dict[str, Any], *, model_type: str, text_model_types: tuple[str, ...], max_positions: int
) -> dict[str, Any]:
    """The :class:`VLArch` fields but ``vision`` of a ``config.json`` dict of ``model_type`` whose
    ``text_config`` (of one of ``text_model_types``) is a Qwen3 dense model with 1-D RoPE (no QKV bias)."""
    expect_model_type(cfg, model_type)
    text = cfg.get("text_config") or {}
    refuse_value(text, "text_config", "model_type", text_model_types)
    refuse_value(text, "text_config", "attention_bias", (False,))
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"]))
    lm = lm_fields(cfg, rope_1d(text, head_dim), max_positions=max_positions, own_head_dim=True)
    return {**lm, **special_ids(cfg), "source": cfg}


def language_flop_shape(arch: QwenLMArch) -> LanguageFlopShape:
    """The dimensions of the language model that the FLOP count reads (with experts: each token runs its
    top-k experts and the router)."""
    moe = arch.moe
    return LanguageFlopShape(
        hidden_size=arch.hidden_size, num_layers=arch.num_layers,
        attention_size=arch.num_attention_heads * arch.head_dim,
        kv_size=arch.num_key_value_heads * arch.head_dim,
        ffn_hidden_size=moe.ffn_hidden_size if moe else arch.intermediate_size, vocab_size=arch.vocab_size,
        experts_per_token=moe.top_k if moe else 0, num_experts=moe.num_experts if moe else 0,
    )  # fmt: skip


def language_config(
    arch: QwenLMArch, common: dict[str, Any], extra: dict[str, Any], *, qkv_bias: bool, qk_norm: bool
) -> TransformerConfig:
    """megatron-core config of the language model; ``common`` holds the run's parallel/precision fields,
    ``extra`` the language model's own (sequence parallelism, pipeline split, recomputation; with experts
    their dispatcher, ``moe_token_dispatcher_type``, allgather when not given)."""
    if arch.moe is not None:
        dispatcher = extra.get("moe_token_dispatcher_type", "allgather")
        extra = {**extra, **moe_config_fields(arch.moe, dispatcher)}
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        qk_layernorm=qk_norm,
        mrope_section=list(arch.mrope_section),
        **common,
        **extra,
    )


class InterleavedMRoPE(MultimodalRotaryEmbedding):
    """Qwen3-VL's multimodal RoPE (see the module docstring): megatron-core's ``MultimodalRotaryEmbedding``
    with the frequencies of the three axes interleaved instead of in contiguous sections."""

    def forward(  # type: ignore[override]
        self, position_ids: torch.Tensor, mrope_section: list[int], cp_group: Any = None
    ) -> torch.Tensor:
        """[3, b, s] positions -> [s, b, 1, head_dim] rotary angles (rotate-half layout)."""
        if cp_group is not None and cp_group.size() > 1:
            raise ValueError("interleaved MRoPE does not support context parallelism")
        inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids.float()[..., None] * inv_freq  # [3, b, s, dim / 2]
        angles = freqs[0].clone()
        half = angles.shape[-1]
        for axis, offset in ((1, 1), (2, 2)):
            index = torch.arange(offset, min(3 * mrope_section[axis], half), 3, device=angles.device)
            angles[..., index] = freqs[axis][..., index]
        emb = torch.cat([angles, angles], dim=-1)  # [b, s, dim]
        return emb.transpose(0, 1)[:, :, None, :].contiguous()


def build_language_model(
    arch: QwenLMArch, config: TransformerConfig, *, pre_process: bool, post_process: bool, use_te: bool,
    vp_stage: int | None, interleaved_mrope: bool = False,
) -> GPTModel:  # fmt: skip
    """The ``GPTModel`` of one pipeline stage (or model chunk ``vp_stage``), taking its input embeddings
    as ``decoder_input`` (whole sequence: vision features go in before it is scattered for SP)."""
    block = build_block_spec(
        get_num_layers_to_build(config, vp_stage=vp_stage), use_te=use_te,
        fp32_residual=config.fp32_residual_connection, qk_norm=config.qk_layernorm,
        num_experts=config.num_moe_experts,
        context_parallel=config.context_parallel_size > 1 and not use_te,
    )  # fmt: skip
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="mrope",
        rotary_base=int(arch.rope_theta),
        scatter_embedding_sequence_parallel=False,
        vp_stage=vp_stage,
    )
    if interleaved_mrope:  # the same frequencies (inv_freq), assigned to the axes as Qwen3-VL does
        model.rotary_pos_emb = InterleavedMRoPE(arch.head_dim, 1.0, rotary_base=int(arch.rope_theta))
    # under CP the positions are already this rank's (the CP split takes them with the tokens): megatron-core
    # must not cut the rotary angles into its own CP chunks of the whole sequence again
    model.rotary_pos_emb.cp_group = None
    return model


def decoder_rules(
    arch: QwenLMArch, first: int, count: int, *, hf_layers: str, qkv_bias: bool, qk_norm: bool
) -> dict[str, Rule]:
    """HF rules of ``count`` decoder layers from global layer ``first`` (HF names ``{hf_layers}{i}.``); with
    ``arch.moe`` each layer's MLP is that mixture of experts."""
    moe = arch.moe
    attn = dict(heads=arch.num_attention_heads, groups=arch.num_key_value_heads, head_dim=arch.head_dim)
    rules: dict[str, Rule] = {}
    for local in range(count):
        hf, mc = f"{hf_layers}{first + local}.", f"language_model.decoder.layers.{local}."
        qkv = tuple(hf + f"self_attn.{p}_proj." for p in "qkv")
        rules |= {
            mc + "input_layernorm.weight": Rule("copy", (hf + "input_layernorm.weight",), None),
            mc + "self_attention.linear_qkv.weight": Rule("qkv", tuple(n + "weight" for n in qkv), **attn),
            mc + "self_attention.linear_proj.weight": Rule("copy", (hf + "self_attn.o_proj.weight",), 1),
            mc + "pre_mlp_layernorm.weight": Rule("copy", (hf + "post_attention_layernorm.weight",), None),
        }
        if moe is not None:
            rules |= moe_rules(moe, arch.hidden_size, hf + "mlp.", mc + "mlp.")
        else:
            rules[mc + "mlp.linear_fc1.weight"] = Rule(
                "glu", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
            )
            rules[mc + "mlp.linear_fc2.weight"] = Rule("copy", (hf + "mlp.down_proj.weight",), 1)
        if qkv_bias:
            rules[mc + "self_attention.linear_qkv.bias"] = Rule("qkv", tuple(n + "bias" for n in qkv), **attn)
        if qk_norm:
            for which in "qk":
                rules[mc + f"self_attention.{which}_layernorm.weight"] = Rule(
                    "copy", (hf + f"self_attn.{which}_norm.weight",), None
                )
    return rules


def language_rules(
    arch: QwenLMArch, *, first: bool, last: bool, layers: tuple[int, int], prefix: str, qkv_bias: bool,
    qk_norm: bool,
) -> dict[str, Rule]:  # fmt: skip
    """HF rules of the language model in a consecutive part of the model: its ``layers`` (first global layer,
    count), with ``first`` the word embedding, with ``last`` the final norm and output layer; HF names
    ``{prefix}layers.{i}.``, ``{prefix}embed_tokens``, ``{prefix}norm`` and ``lm_head``."""
    rules = decoder_rules(arch, *layers, hf_layers=prefix + "layers.", qkv_bias=qkv_bias, qk_norm=qk_norm)
    return rules | output_rules(
        first=first, last=last, tied=arch.tie_word_embeddings, norm=prefix + "norm.weight",
        embedding=prefix + "embed_tokens.weight",
    )  # fmt: skip


def tiny_vlm_config(
    spec: TinyModelSpec, *, architecture: str, model_type: str, text_model_type: str,
    rope_parameters: dict[str, Any], qwen3: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """The special ids and the ``text_config`` (``rope_parameters``; ``qwen3``: a Qwen3 model's ``head_dim``
    and no attention bias, else Qwen2's keys) of a small random vision-language ``config.json``; the family
    adds its ``vision_config``."""
    text = {
        "model_type": text_model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size or 4 * spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": spec.tie_word_embeddings,
    }
    if qwen3:
        text |= {"head_dim": spec.hidden_size // spec.num_attention_heads, "attention_bias": False}
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "image_token_id": spec.image_token_id,
        "video_token_id": spec.image_token_id + 1,
        "vision_start_token_id": spec.vision_start_token_id,
        "vision_end_token_id": spec.vision_end_token_id,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "text_config": text,
    }
