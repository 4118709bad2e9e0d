"""megatron-core pieces shared by the model families: the RMSNorm and LayerNorm, the residual add and the
layer specs.

megatron-core's local spec uses ``WrappedTorchNorm``, which refuses ``sequence_parallel`` and cannot take an
fp32 residual stream with half-precision weights. :class:`RMSNorm` does both (the role Apex's fused norms play
on GPU machines) and computes exactly as transformers' Qwen2 RMSNorm does (fp32 statistics, weight applied
after the cast back); its parameters are marked ``sequence_parallel`` so that ``finalize_model_grads``
all-reduces their gradients over TP.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.Module):
    """RMSNorm with fp32 statistics; output in the parameter dtype; sequence-parallel aware."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(hidden_states.dtype)).to(self.weight.dtype)


class LayerNorm(torch.nn.Module):
    """LayerNorm with weight and bias (the vision towers' norms, transformers' ``nn.LayerNorm``), computed in
    the input dtype; sequence-parallel aware as :class:`RMSNorm`."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size))
        for p in (self.weight, self.bias):
            p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.bias, self.eps)


def get_residual_bias_dropout_add(training: bool, fused: bool = False):
    """Bias-dropout-add that keeps the residual stream in its own dtype.

    megatron-core's version casts the residual to the branch dtype, which would turn
    ``--fp32-residual-connection`` back into a bf16/fp16 residual after the first layer (TE layers keep
    it in fp32 themselves); here the branch output is added to the fp32 residual instead.
    """

    def bias_dropout_add(x_with_bias: tuple, residual: torch.Tensor, prob: float) -> torch.Tensor:
        x, bias = x_with_bias
        if bias is not None:
            x = x + bias
        out = F.dropout(x, p=prob, training=training)
        return residual + out.to(residual.dtype)

    return bias_dropout_add


def build_layer_spec(
    attn_mask_type: AttnMaskType, *, norm: type[torch.nn.Module] = RMSNorm, qk_norm: bool = False,
    num_experts: int | None = None,
) -> ModuleSpec:  # fmt: skip
    """megatron-core's local (no Transformer Engine) GPT layer with our ``norm`` (RMSNorm or LayerNorm) and
    the given mask type; ``qk_norm``: RMSNorm over each query and key head (Qwen3); ``num_experts``: a
    mixture-of-experts MLP (megatron-core's MoE layer, one MLP per expert)."""
    spec = copy.deepcopy(
        get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm, num_experts=num_experts)
    )
    sub = spec.submodules
    sub.input_layernorm = norm
    sub.pre_mlp_layernorm = norm
    if qk_norm:
        sub.self_attention.submodules.q_layernorm = RMSNorm
        sub.self_attention.submodules.k_layernorm = RMSNorm
    sub.self_attn_bda = get_residual_bias_dropout_add
    sub.mlp_bda = get_residual_bias_dropout_add
    sub.self_attention.params = {**sub.self_attention.params, "attn_mask_type": attn_mask_type}
    return spec


def build_block_spec(
    num_local_layers: int, *, use_te: bool = False, fp32_residual: bool = False, qk_norm: bool = False,
    num_experts: int | None = None, context_parallel: bool = False,
) -> TransformerBlockSubmodules:  # fmt: skip
    """Decoder block spec: ``num_local_layers`` layers of this pipeline stage plus the final norm
    (``qk_norm``: with RMSNorm over each query and key head; ``num_experts``: mixture-of-experts MLPs;
    ``context_parallel``: without TE, the all-gather attention of
    :mod:`mmpack.trainer.models.cp_attention`).

    Without TE the block-diagonal packed mask is passed densely (``AttnMaskType.arbitrary``); with TE the
    attention takes ``PackedSeqParams`` (THD, cu_seqlens) and its own causal-per-segment kernel.
    """
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        layer = get_gpt_layer_with_transformer_engine_spec(
            normalization="RMSNorm", qk_layernorm=qk_norm, num_experts=num_experts, moe_grouped_gemm=False
        )
        if fp32_residual:
            return TransformerBlockSubmodules(
                layer_specs=[unfused_te_layer_spec(layer)] * num_local_layers, layer_norm=RMSNorm
            )
        return TransformerBlockSubmodules(layer_specs=[layer] * num_local_layers, layer_norm=TENorm)
    layer = build_layer_spec(AttnMaskType.arbitrary, qk_norm=qk_norm, num_experts=num_experts)
    if context_parallel:
        from mmpack.trainer.models.cp_attention import GatheredKVAttention

        layer.submodules.self_attention.submodules.core_attention = GatheredKVAttention
    return TransformerBlockSubmodules(layer_specs=[layer] * num_local_layers, layer_norm=RMSNorm)


def unfused_te_layer_spec(te_layer: ModuleSpec) -> ModuleSpec:
    """TE's layer for ``--fp32-residual-connection``: TE modules take one dtype, so the norms that TE fuses
    into the next linear layer become :class:`RMSNorm` (fp32 residual in, bf16/fp16 out) before plain TE
    linears, and the residual add keeps the fp32 stream. Checkpoint keys stay those of the fused layer."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

    spec = copy.deepcopy(te_layer)
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    sub.self_attention.submodules.linear_qkv = TEColumnParallelLinear
    sub.mlp.submodules.linear_fc1 = TEColumnParallelLinear
    sub.self_attn_bda = get_residual_bias_dropout_add
    sub.mlp_bda = get_residual_bias_dropout_add
    sub.sharded_state_dict_keys_map = {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    }
    return spec
