"""Gemma 4's language model on megatron-core's tensor-parallel layers: one pipeline stage of decoder layers.

megatron-core's ``TransformerBlock`` builds every layer from one config, while Gemma 4's layers differ in head
size, KV-head count, value projection and MLP width, and some layers take their keys and values from an earlier
layer; so the layers here are the family's own modules made of megatron-core's ``ColumnParallelLinear`` /
``RowParallelLinear`` / ``VocabParallelEmbedding`` (tensor and sequence parallel as megatron-core's own layers).

A layer (as transformers' ``Gemma4TextDecoderLayer``): RMSNorm -> attention (QK-norm, a scale-free V-norm, RoPE of
its layer type, scale 1, :func:`mmpack.trainer.models.gemma4.masks.packed_attention` within each sample) -> RMSNorm,
residual; RMSNorm -> GELU-tanh gated MLP -> RMSNorm, residual; with per-layer embeddings (PLE) a gate from the
hidden state times the layer's PLE slice, projected back, RMSNorm, residual; the result times ``layer_scalar``.

Keys and values: a layer whose KV heads divide over TP cuts them like its query heads. One with fewer KV heads than
TP ranks (Gemma 4's full-attention layers often have one) computes them whole on every rank and each rank keeps the
heads its query heads use; the copy before that cut sums the ranks' gradients (megatron-core's
``copy_to_tensor_model_parallel_region``), so the replicated weights get the whole gradient on every rank.
A KV-sharing layer attends to the keys and values of its source layer, which must be on the same pipeline stage.

Sample boundaries come from the positions (each sample counts from 0, the family's position rule), images from the
tokens (runs of image / video soft tokens), so the stage needs no mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, sharded_state_dict_default

from mmpack.trainer.models.common import RMSNorm
from mmpack.trainer.models.gemma4 import rope
from mmpack.trainer.models.gemma4.config import Gemma4TextArch
from mmpack.trainer.models.gemma4.masks import packed_attention


def _init(config: TransformerConfig) -> Any:
    return config.init_method


def _mark_sequence_parallel(module: torch.nn.Module, config: TransformerConfig) -> None:
    """Parameters of a module applied per token to the sequence-parallel residual: under sequence parallelism
    each rank sees its own tokens, so megatron-core sums their gradients over TP (as its layer norms')."""
    for p in module.parameters():
        p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


class ScaleFreeRMSNorm(torch.nn.Module):
    """RMSNorm without a weight (Gemma 4's value norm and the projector's pre-norm), statistics in fp32."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return (y * torch.pow(y.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).type_as(x)


class HeadNorm(RMSNorm):
    """RMSNorm over each head of [..., heads, head_dim] (QK-norm); its weight is shared by the heads, which TP
    cuts, so megatron-core sums its gradient over TP (by its name, ``q_layernorm`` / ``k_layernorm``, with the
    config's ``qk_layernorm``)."""

    def __init__(self, config: TransformerConfig, head_dim: int, eps: float) -> None:
        super().__init__(config, head_dim, eps=eps)
        self.weight.sequence_parallel = False  # type: ignore[attr-defined]  # summed by name instead


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """[N, heads, d] rotated by [N, d] angles, the first half of each head against the second."""
    cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class PackedContext:
    """What every layer of one forward needs about the packed micro-batch: token-major sample boundaries
    (``cu_seqlens`` over the flattened [b * s] tokens), image runs, positions and the rotary angles per layer type."""

    def __init__(self, arch: Gemma4TextArch, positions: torch.Tensor, blocks: torch.Tensor | None) -> None:
        flat = positions.reshape(-1)  # [b * s], token-major
        starts = torch.nonzero(flat == 0).reshape(-1)
        if len(starts) == 0 or int(starts[0]) != 0:
            raise ValueError("Gemma 4 positions must count each sample from 0 (the family's position rule)")
        self.cu_seqlens = torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)]).to(
            torch.int64
        )
        self.blocks = blocks
        self.positions = flat
        self._angles: dict[tuple[str, int], torch.Tensor] = {}
        self.arch = arch
        self.shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def angles(self, layer: int) -> torch.Tensor:
        key = (self.arch.layer_types[layer], self.arch.layer_head_dim(layer))
        if key not in self._angles:
            self._angles[key] = rope.angles(self.arch, layer, self.positions)
        return self._angles[key]


class Gemma4Attention(MegatronModule):
    """Self-attention of one layer (see the module docstring); parameters ``linear_q``, ``linear_k``,
    ``linear_v`` (absent where values are keys, or where the layer shares KV), ``q_layernorm``, ``k_layernorm``,
    ``linear_proj``."""

    def __init__(self, config: TransformerConfig, arch: Gemma4TextArch, layer: int) -> None:
        super().__init__(config)
        tp = config.tensor_model_parallel_size
        self.layer = layer
        self.head_dim = d = arch.layer_head_dim(layer)
        heads, kv = arch.num_attention_heads, arch.layer_kv_heads(layer)
        if heads % tp:
            raise ValueError(f"Gemma 4: {heads} attention heads cannot be split over TP {tp}")
        self.heads = heads // tp
        self.window = arch.sliding_window if arch.is_sliding(layer) else None
        self.bidirectional = arch.bidirectional_vision and arch.is_sliding(layer)
        self.source = arch.kv_source(layer)
        self.shares_kv = self.source != layer
        h, eps = arch.hidden_size, arch.rms_norm_eps
        column = dict(config=config, init_method=_init(config), bias=False, gather_output=False)
        self.linear_q = tensor_parallel.ColumnParallelLinear(h, heads * d, **column)
        self.q_layernorm = HeadNorm(config, d, eps)
        self.replicated_kv = kv % tp != 0
        if self.replicated_kv and tp % kv:
            raise ValueError(f"Gemma 4 layer {layer}: {kv} KV heads and TP {tp}: one must divide the other")
        rank = ps.get_tensor_model_parallel_rank() if tp > 1 else 0
        group = heads // kv  # query heads per KV head
        first_q = rank * self.heads
        self.kv_heads = slice(first_q // group, (first_q + self.heads - 1) // group + 1)
        if not self.shares_kv:
            self.k_layernorm = HeadNorm(config, d, eps)
            self.linear_k = self._kv_linear(config, h, kv * d, column)
            self.linear_v = (
                self._kv_linear(config, h, kv * d, column) if arch.has_value_projection(layer) else None
            )
        self.v_norm = ScaleFreeRMSNorm(eps)
        self.linear_proj = tensor_parallel.RowParallelLinear(
            heads * d, h, config=config, init_method=config.output_layer_init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True,
        )  # fmt: skip

    def _kv_linear(
        self, config: TransformerConfig, h: int, out: int, column: dict[str, Any]
    ) -> torch.nn.Module:
        if self.replicated_kv:
            return torch.nn.Linear(h, out, bias=False)
        return tensor_parallel.ColumnParallelLinear(h, out, **column)

    def _project_kv(self, linear: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """[s, b, this rank's KV heads * d] of one of the K / V projections."""
        if not self.replicated_kv:
            return linear(hidden)[0]
        if self.config.sequence_parallel:  # the whole sequence; its gradient is whole on every rank (below)
            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False
            )
        whole = tensor_parallel.copy_to_tensor_model_parallel_region(linear(hidden))
        s, b, _ = whole.shape
        return whole.reshape(s, b, -1, self.head_dim)[:, :, self.kv_heads].reshape(s, b, -1)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Checkpoint shards without the K / V projections' (empty) extra state, which a replicated projection
        (fewer KV heads than TP ranks) has not: a checkpoint has the same keys under every TP size."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return {
            k: v for k, v in out.items() if not k.endswith(("linear_k._extra_state", "linear_v._extra_state"))
        }

    def _token_major(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, heads * d] -> [b * s, heads, d]."""
        s, b, _ = x.shape
        return x.transpose(0, 1).reshape(b * s, -1, self.head_dim)

    def forward(self, hidden: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        angles = ctx.angles(self.layer)
        q_sb = self.linear_q(hidden)[0]
        s, b, _ = q_sb.shape
        q = rotate(self.q_layernorm(self._token_major(q_sb)), angles)
        if self.shares_kv:
            if self.source not in ctx.shared_kv:
                raise ValueError(
                    f"Gemma 4 layer {self.layer} reuses the keys and values of layer {self.source}, which this "
                    "pipeline stage does not hold: split the pipeline so that they share a stage "
                    "(--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)"
                )
            k, v = ctx.shared_kv[self.source]
        else:
            k_raw = self._token_major(self._project_kv(self.linear_k, hidden))
            v_raw = (
                k_raw if self.linear_v is None else self._token_major(self._project_kv(self.linear_v, hidden))
            )
            k = rotate(self.k_layernorm(k_raw), angles)
            v = self.v_norm(v_raw)
            ctx.shared_kv[self.layer] = (k, v)
        out = packed_attention(
            q, k, v, ctx.cu_seqlens, ctx.blocks if self.bidirectional else None, window=self.window, scale=1.0
        )
        out = out.reshape(b, s, -1).transpose(0, 1).contiguous()
        return self.linear_proj(out)[0]


class Gemma4MLP(MegatronModule):
    """GELU-tanh gated MLP: ``linear_fc1`` (this rank's gate rows, then its up rows), ``linear_fc2``."""

    def __init__(self, config: TransformerConfig, hidden: int, ffn: int) -> None:
        super().__init__(config)
        self.linear_fc1 = tensor_parallel.ColumnParallelLinear(
            hidden, 2 * ffn, config=config, init_method=_init(config), bias=False, gather_output=False
        )
        self.linear_fc2 = tensor_parallel.RowParallelLinear(
            ffn, hidden, config=config, init_method=config.output_layer_init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x)[0].chunk(2, dim=-1)
        return self.linear_fc2(F.gelu(gate, approximate="tanh") * up)[0]

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Checkpoint shards with ``linear_fc1``'s gate and up rows as two tensors (megatron-core's SwiGLU factory,
        as its ``MLP``), so that a checkpoint reshards to another TP size."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        key, singleton = f"{prefix}linear_fc1.weight", (metadata or {}).get("singleton_local_shards", False)
        out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
        return out


class Gemma4Router(MegatronModule):
    """Gemma 4's router, in megatron-core's ``MoELayer`` as its router (``(probs, routing_map)`` per token): the
    layer's input before the experts' norm (handed over in ``raw``, since megatron-core gives the router the experts'
    input), RMSNorm without weight, times ``scale`` / sqrt(hidden), projected (``proj``), softmax, top-k renormalised,
    times each chosen expert's ``per_expert_scale``."""

    def __init__(self, config: TransformerConfig, pg_collection: Any = None) -> None:
        super().__init__(config)
        h, experts = config.hidden_size, int(config.num_moe_experts or 0)
        self.top_k, self.num_experts = int(config.moe_router_topk), experts
        self.norm = ScaleFreeRMSNorm(config.layernorm_epsilon)
        self.proj = torch.nn.Linear(h, experts, bias=False)
        self.scale = torch.nn.Parameter(torch.ones(h))
        self.per_expert_scale = torch.nn.Parameter(torch.ones(experts))
        _mark_sequence_parallel(self, config)  # per token, on this rank's tokens under SP
        self.raw: torch.Tensor | None = None

    def set_layer_number(self, layer_number: int) -> None:  # megatron-core's MoELayer numbers its router
        self.layer_number = layer_number

    def forward(self, hidden: torch.Tensor, padding_mask: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.raw is not None, "the MoE block hands the router its input"
        x = self.raw.reshape(-1, self.raw.shape[-1])
        x = self.norm(x) * self.scale * x.shape[-1] ** -0.5
        probs = torch.softmax(self.proj(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[chosen]
        dense = torch.zeros_like(probs).scatter(1, chosen, weights)
        routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter(1, chosen, True)
        return dense, routing_map


def _moe_layer_class() -> type:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return MoELayer


class Gemma4MoE(_moe_layer_class()):  # type: ignore[misc]
    """The MLP of a layer of the MoE variant: the dense MLP (``dense``, then ``post_dense_layernorm``) beside
    megatron-core's experts (``experts``, ``router``: :class:`Gemma4Router`) on the experts' own norm
    (``pre_experts_layernorm``, then ``post_experts_layernorm``), summed. Under TP megatron-core's MoE needs sequence
    parallelism."""

    def __init__(self, config: TransformerConfig, arch: Gemma4TextArch, layer: int) -> None:
        import dataclasses

        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.moe.moe_layer import MoESubmodules

        h, eps = arch.hidden_size, arch.rms_norm_eps
        moe_config = dataclasses.replace(
            config, hidden_size=h
        )  # the true width (the pipeline's may be wider)
        spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
        submodules = MoESubmodules(experts=spec.submodules.experts, router=Gemma4Router)
        super().__init__(moe_config, submodules=submodules, layer_number=layer + 1)
        self.dense = Gemma4MLP(config, h, arch.layer_intermediate_size(layer))
        self.post_dense_layernorm = RMSNorm(config, h, eps=eps)
        self.pre_experts_layernorm = RMSNorm(config, h, eps=eps)
        self.post_experts_layernorm = RMSNorm(config, h, eps=eps)

    def both(self, normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The dense MLP on ``normed`` (the layer's pre-MLP norm of ``residual``) plus the experts on ``residual``."""
        dense = self.post_dense_layernorm(self.dense(normed))
        self.router.raw = residual
        try:
            experts, _ = super().forward(self.pre_experts_layernorm(residual))
        finally:
            self.router.raw = None
        return dense + self.post_experts_layernorm(experts)


class Gemma4Layer(MegatronModule):
    """One decoder layer (``layer``: 0-based, global); ``layer_number`` counts from 1 as megatron-core's."""

    def __init__(self, config: TransformerConfig, arch: Gemma4TextArch, layer: int) -> None:
        super().__init__(config)
        self.layer_number = layer + 1
        self.layer = layer
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = RMSNorm(config, h, eps=eps)
        self.self_attention = Gemma4Attention(config, arch, layer)
        self.post_attention_layernorm = RMSNorm(config, h, eps=eps)
        self.pre_mlp_layernorm = RMSNorm(config, h, eps=eps)
        self.moe = arch.moe is not None
        self.mlp: torch.nn.Module = (
            Gemma4MoE(config, arch, layer)
            if self.moe
            else Gemma4MLP(config, h, arch.layer_intermediate_size(layer))
        )
        self.post_mlp_layernorm = RMSNorm(config, h, eps=eps)
        self.ple = arch.hidden_size_per_layer_input
        if self.ple:
            self.ple_gate = torch.nn.Linear(h, self.ple, bias=False)
            self.ple_projection = torch.nn.Linear(self.ple, h, bias=False)
            self.ple_layernorm = RMSNorm(config, h, eps=eps)
            for m in (self.ple_gate, self.ple_projection):
                _mark_sequence_parallel(m, config)
        self.register_buffer("layer_scalar", torch.ones(1), persistent=True)

    def forward(
        self, hidden: torch.Tensor, ctx: PackedContext, ple_input: torch.Tensor | None
    ) -> torch.Tensor:
        residual = hidden
        attn = self.self_attention(self.input_layernorm(hidden), ctx)
        hidden = residual + self.post_attention_layernorm(attn)
        residual = hidden
        normed = self.pre_mlp_layernorm(hidden)
        mlp = self.mlp.both(normed, residual) if self.moe else self.mlp(normed)  # type: ignore[operator]
        hidden = residual + self.post_mlp_layernorm(mlp)
        if self.ple:
            assert ple_input is not None
            gated = F.gelu(self.ple_gate(hidden), approximate="tanh") * ple_input
            hidden = hidden + self.ple_layernorm(self.ple_projection(gated))
        return hidden * self.layer_scalar.to(hidden.dtype)


class Decoder(MegatronModule):
    """The stage's layers (``layers``, numbered from 0 on each stage) and, on the last stage, the final norm
    (``final_layernorm``); checkpoint keys number the layers globally, as megatron-core's ``TransformerBlock``."""

    def __init__(self, config: TransformerConfig, arch: Gemma4TextArch, first: int, count: int, last: bool):
        super().__init__(config)
        self.layers = torch.nn.ModuleList(Gemma4Layer(config, arch, i) for i in range(first, first + count))
        self.final_layernorm = RMSNorm(config, arch.hidden_size, eps=arch.rms_norm_eps) if last else None

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out: dict = {}
        layers: list[Gemma4Layer] = list(self.layers)  # type: ignore[arg-type]
        for local, layer in enumerate(layers):
            local_prefix = f"{prefix}layers.{local}."
            layer_sd = layer.sharded_state_dict(local_prefix, sharded_offsets, metadata)
            replace_prefix_for_sharding(layer_sd, local_prefix, f"{prefix}layers.{layer.layer}.")
            out |= layer_sd
        if self.final_layernorm is not None:
            out |= sharded_state_dict_default(
                self.final_layernorm, f"{prefix}final_layernorm.", sharded_offsets, metadata,
                tp_group=ps.get_tensor_model_parallel_group(),
            )  # fmt: skip
        return out


class Embedding(MegatronModule):
    """The word embeddings and, with PLE, the per-layer table, its projection from the embeddings and its norm."""

    def __init__(self, config: TransformerConfig, arch: Gemma4TextArch) -> None:
        super().__init__(config)
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, init_method=_init(config), config=config
        )
        ple = arch.hidden_size_per_layer_input
        if ple:
            width = arch.num_layers * ple
            self.per_layer_embeddings = tensor_parallel.VocabParallelEmbedding(
                arch.vocab_size_per_layer_input, width, init_method=_init(config), config=config
            )
            # the projection and its norm see the whole sequence on every rank: their gradients are whole
            self.per_layer_projection = torch.nn.Linear(arch.hidden_size, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(config, ple, eps=arch.rms_norm_eps)
            self.per_layer_projection_norm.weight.sequence_parallel = False  # type: ignore[attr-defined]


def layers_of(arch: Gemma4TextArch, config: TransformerConfig, vp_stage: int | None) -> tuple[int, int]:
    """(first global layer, count) of this stage (or model chunk), by megatron-core's split rules."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return get_transformer_layer_offset(config, vp_stage=vp_stage), count
