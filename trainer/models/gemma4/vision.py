"""The Gemma 4 vision tower and its projector on megatron-core (transformers' ``Gemma4VisionModel`` and
``Gemma4MultimodalEmbedder``, ``embed_vision``): pixels of the loader's layout in, soft tokens in the language
model's hidden size out, ready to be scattered over the ``<|image|>`` tokens.

- Patch embedding: pixels in [0, 1] scaled to [-1, 1], a bias-free linear over each patch's (y, x, channel)
  pixels, plus a learned 2-D position table (column embedding + row embedding).
- Layers: RMSNorm before and after attention and before and after the MLP (Gemma's sandwich norms); attention
  with RMSNorm over each query and key head (scaled), over each value head (not scaled), no softmax scaling,
  and 2-D rotary positions: the first half of a head turns with the patch's column, the second with its row,
  each half rotating its own two quarters against each other; a GELU-tanh gated MLP. Attention is
  bidirectional inside each image and never across images (cu_seqlens segments, no dense [P, P] mask).
- Pooling: the mean of each k x k window of patches (k = ``pooling_kernel_size``) times sqrt(hidden).
- Projector (``embedder``): RMSNorm without scale, a bias-free linear to the language hidden size.

Layout mapping: the loader's rows (``packing/image_tokens.image_to_patches``, Gemma 4 rule: temporal patch 1,
rescaled to [0, 1], not normalised) are merge-window-major with merge = the pooling kernel, each row
(channel, y, x); transformers' are row-major (y, x, channel) with (x, y) positions. The pooling windows are
then k x k consecutive rows, in the same (row-major) order as transformers' pooled tokens.

megatron-core's ``TransformerLayer`` has no norms after attention and the MLP, nor a value norm, and its
rotary pairs channels across the whole head, so the layer is written here from megatron-core's
``ColumnParallelLinear`` / ``RowParallelLinear`` (tensor parallel over heads and MLP columns). Like the other
towers it runs on the first pipeline stage only and is never sequence-parallel. The query and key norm weights
see only this rank's heads, so their gradients are summed over TP in the backward pass here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, sharded_state_dict_default

from mmpack.trainer.models.common import RMSNorm
from mmpack.trainer.models.gemma4.config import Gemma4Arch
from mmpack.trainer.models.hf_weights import Rule
from mmpack.trainer.models.segment_attention import segment_attention
from mmpack.trainer.models.vision_common import patch_hw_positions

VISION, EMBEDDER = "vision.", "vision.embedder."  # parameter prefixes: the tower, its projector
HF_TOWER, HF_EMBEDDER = "model.vision_tower.", "model.embed_vision."


def vision_source(arch: Gemma4Arch) -> dict[str, Any]:
    """The ``vision_config`` fields :class:`Gemma4VisionArch` does not hold, checked: (rope theta, activation).
    ValueError naming a field this tower does not implement."""
    vc = arch.source.get("vision_config", {})
    unsupported = {"use_clipped_linears": True, "standardize": True, "attention_bias": True}
    for key, bad in unsupported.items():
        if vc.get(key) == bad:
            raise ValueError(
                f"Gemma 4 config.json vision_config.{key}={bad} is not supported by mmpack's vision tower yet"
            )
    rope = vc.get("rope_parameters") or {"rope_type": "axial", "rope_theta": 100.0}
    act = vc.get("hidden_activation", "gelu_pytorch_tanh")
    if rope.get("rope_type", "axial") != "axial" or act != "gelu_pytorch_tanh":
        raise ValueError(
            f"Gemma 4 config.json vision_config: rope {rope!r} / hidden_activation {act!r} not supported "
            "(axial rope, gelu_pytorch_tanh)"
        )
    return {"rope_theta": float(rope.get("rope_theta", 100.0))}


def vision_tower_config(arch: Gemma4Arch, common: dict[str, Any]) -> TransformerConfig:
    """megatron-core config of the tower and its projector (``common``: the run's parallel/precision fields).
    First pipeline stage only, not sequence-parallel, residual in the parameter dtype."""
    v = arch.vision
    tp = int(common["tensor_model_parallel_size"])
    if v.num_heads % tp or v.num_key_value_heads % tp or v.intermediate_size % tp:
        raise ValueError(
            f"Gemma 4 vision tower: TP {tp} must divide its {v.num_heads} heads, {v.num_key_value_heads} KV heads "
            f"and MLP width {v.intermediate_size}"
        )
    fields = {**common, "pipeline_model_parallel_size": 1, "fp32_residual_connection": False}
    return TransformerConfig(
        num_layers=v.depth, hidden_size=v.hidden_size, num_attention_heads=v.num_heads,
        num_query_groups=v.num_key_value_heads, kv_channels=v.head_dim, ffn_hidden_size=v.intermediate_size,
        layernorm_epsilon=v.rms_norm_eps, add_bias_linear=False, sequence_parallel=False, **fields,
    )  # fmt: skip


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [P, head_dim] of patches at (column, row) ``positions`` [P, 2]: head_dim / 4 frequencies of the
    half-head size, the column's twice then the row's twice."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=positions.device) / half)
    freqs = positions.float()[..., None] * inv_freq  # [P, 2, head_dim / 4]
    col, row = freqs[:, 0], freqs[:, 1]
    angles = torch.cat([col, col, row, row], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [P, heads, head_dim] rotated: each half of a head its two quarters against each other."""
    out = []
    for part, c, s in zip(x.chunk(2, -1), cos.chunk(2, -1), sin.chunk(2, -1), strict=True):
        a, b = part.chunk(2, -1)
        out.append(part * c[:, None] + torch.cat([-b, a], dim=-1) * s[:, None])
    return torch.cat(out, dim=-1).to(x.dtype)


def rms_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without scale, statistics in fp32, in ``x``'s dtype."""
    f = x.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class HeadNorm(RMSNorm):
    """RMSNorm over each head of this rank's heads: its weight's gradient is summed over TP ranks here (the
    modules are named ``q_norm`` / ``k_norm``, not ``q_layernorm``, which ``finalize_model_grads`` would sum
    again when the language model has QK-norm)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tensor_model_parallel_region(self.weight)
        return (weight * rms_normed(hidden_states.float(), self.eps)).to(hidden_states.dtype)


class LayerList(torch.nn.ModuleList):
    """A ``ModuleList`` whose checkpoint shards are its members' own (a plain list would be saved as
    replicated over TP)."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out: dict = {}
        for i, member in enumerate(self):
            tp_group = ps.get_tensor_model_parallel_group()
            out |= sharded_state_dict_default(
                member, f"{prefix}{i}.", sharded_offsets, metadata, tp_group=tp_group
            )
        return out


def _column(
    config: TransformerConfig, n_in: int, n_out: int, *, gather: bool = False
) -> ColumnParallelLinear:
    return ColumnParallelLinear(
        n_in, n_out, config=config, init_method=config.init_method, bias=False, gather_output=gather
    )


def _row(config: TransformerConfig, n_in: int, n_out: int) -> RowParallelLinear:
    return RowParallelLinear(
        n_in, n_out, config=config, init_method=config.output_layer_init_method, bias=False,
        input_is_parallel=True, skip_bias_add=False,
    )  # fmt: skip


class VisionAttention(MegatronModule):
    """Fused QKV (megatron-core's per-group [q, k, v] rows), QK-norm, V-norm, 2-D rotary, segment attention."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        tp = config.tensor_model_parallel_size
        self.head_dim = d = int(config.kv_channels or 0)
        self.heads, self.groups = config.num_attention_heads // tp, int(config.num_query_groups or 0) // tp
        heads, groups = config.num_attention_heads, int(config.num_query_groups or 0)
        self.linear_qkv = _column(config, config.hidden_size, (heads + 2 * groups) * d)
        self.q_norm = HeadNorm(config, d, eps=config.layernorm_epsilon)
        self.k_norm = HeadNorm(config, d, eps=config.layernorm_epsilon)
        self.linear_proj = _row(config, heads * d, config.hidden_size)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        n, d, per_group = hidden.shape[0], self.head_dim, self.heads // self.groups
        qkv, _ = self.linear_qkv(hidden)
        q, k, v = qkv.view(n, self.groups, per_group + 2, d).split([per_group, 1, 1], dim=2)
        q = apply_rotary(self.q_norm(q.reshape(n, self.heads, d)), cos, sin)
        k = apply_rotary(self.k_norm(k.reshape(n, self.groups, d)), cos, sin)
        v = rms_normed(v.reshape(n, self.groups, d), self.config.layernorm_epsilon)
        k, v = (t.repeat_interleave(per_group, dim=1) for t in (k, v))
        out = segment_attention(q, k, v, cu_seqlens, scale=1.0)  # QK-norm in place of 1 / sqrt(d)
        return self.linear_proj(out.reshape(n, self.heads * d))[0]


class VisionMLP(MegatronModule):
    """Gated GELU-tanh MLP: ``linear_fc1`` holds this rank's gate rows then its up rows."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        self.linear_fc1 = _column(config, config.hidden_size, 2 * config.ffn_hidden_size)
        self.linear_fc2 = _row(config, config.ffn_hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(hidden)[0].chunk(2, dim=-1)
        return self.linear_fc2(F.gelu(gate, approximate="tanh") * up)[0]

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Checkpoint shards, ``linear_fc1``'s gate and up rows as two tensors (megatron-core's SwiGLU factory, as
        its ``MLP``), so that a checkpoint reshards to another TP size."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        key, singleton = f"{prefix}linear_fc1.weight", (metadata or {}).get("singleton_local_shards", False)
        out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
        return out


class VisionLayer(MegatronModule):
    """One encoder layer: norm, attention, norm, residual; norm, MLP, norm, residual."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(config, h, eps), RMSNorm(config, h, eps)
        self.pre_mlp_layernorm, self.post_mlp_layernorm = RMSNorm(config, h, eps), RMSNorm(config, h, eps)
        self.self_attention = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(hidden), cos, sin, cu_seqlens)
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(hidden)))


class PatchEmbedder(torch.nn.Module):
    """Patch pixels (transformers' (y, x, channel) order) -> hidden, plus column and row position embeddings."""

    def __init__(self, patch_pixels: int, hidden: int, positions: int) -> None:
        super().__init__()
        self.input_proj = torch.nn.Linear(patch_pixels, hidden, bias=False)
        self.position_embedding_table = torch.nn.Parameter(torch.zeros(2, positions, hidden))

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.input_proj((2 * (pixels - 0.5)).to(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        return hidden + table[0][positions[:, 0]] + table[1][positions[:, 1]]


class Embedder(MegatronModule):
    """transformers' ``embed_vision``: RMSNorm without scale, bias-free linear to the language hidden size."""

    def __init__(self, config: TransformerConfig, text_hidden: int) -> None:
        super().__init__(config)
        self.embedding_projection = _column(config, config.hidden_size, text_hidden, gather=True)

    def forward(self, soft: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(rms_normed(soft, self.config.layernorm_epsilon))[0]


class Gemma4VisionTower(MegatronModule):
    """pixel_values [P, 3*p*p] (the loader's layout) + image_grid_thw [n, 3] (t = 1) -> [P / k^2, text hidden]:
    every image's soft tokens, in the images' order, through the projector."""

    def __init__(self, config: TransformerConfig, arch: Gemma4Arch) -> None:
        super().__init__(config)
        v = arch.vision
        self.rope_theta = vision_source(arch)["rope_theta"]
        self.patch, self.kernel, self.head_dim = v.patch_size, v.pooling_kernel_size, v.head_dim
        self.patch_embedder = PatchEmbedder(3 * v.patch_size**2, v.hidden_size, v.position_embedding_size)
        self.layers = LayerList([VisionLayer(config) for _ in range(v.depth)])
        self.embedder = Embedder(config, arch.text.hidden_size)

    def _checked_grids(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> np.ndarray:
        grids = image_grid_thw.detach().cpu().numpy().astype(np.int64).reshape(-1, 3)
        k, width = self.kernel, 3 * self.patch**2
        bad = (grids[:, 0] != 1) | (grids[:, 1] % k != 0) | (grids[:, 2] % k != 0)
        if bad.any() or pixel_values.shape != (int(grids.prod(-1).sum()), width):
            raise ValueError(
                f"Gemma 4 vision tower: pixel_values {tuple(pixel_values.shape)} and grids {grids.tolist()} do not "
                f"match (rows of {width} values, one per patch; t = 1 and sides multiples of {k}): pack the "
                "dataset with the model folder's Gemma 4 image rule"
            )
        return grids

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        grids = self._checked_grids(pixel_values, image_grid_thw)
        device, n, p = pixel_values.device, pixel_values.shape[0], self.patch
        rows_cols = torch.as_tensor(patch_hw_positions(grids, self.kernel), device=device)
        positions = rows_cols.flip(-1)  # (column, row), transformers' (x, y)
        pixels = pixel_values.view(n, 3, p, p).permute(0, 2, 3, 1).reshape(n, -1)
        hidden = self.patch_embedder(pixels, positions)
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.rope_theta)
        cu = torch.zeros(len(grids) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.as_tensor(np.cumsum(grids[:, 1] * grids[:, 2]), device=device)
        for layer in self.layers:
            hidden = layer(hidden, cos.to(hidden.dtype), sin.to(hidden.dtype), cu)
        # the merge windows are k*k consecutive rows, in transformers' pooled order
        pooled = hidden.float().view(-1, self.kernel**2, hidden.shape[-1]).mean(1) * math.sqrt(
            hidden.shape[-1]
        )
        return self.embedder(pooled.to(hidden.dtype))


def vision_rules(arch: Gemma4Arch) -> dict[str, Rule]:
    """megatron-core name (in the stage, under ``vision.``) -> :class:`Rule` of every tower and projector
    parameter, from the HF names ``save_pretrained`` of ``Gemma4ForConditionalGeneration`` writes."""
    v = arch.vision
    rules = {
        VISION + "patch_embedder.input_proj.weight": Rule(
            "copy", (HF_TOWER + "patch_embedder.input_proj.weight",), None
        ),
        VISION + "patch_embedder.position_embedding_table": Rule(
            "copy", (HF_TOWER + "patch_embedder.position_embedding_table",), None
        ),
        EMBEDDER + "embedding_projection.weight": Rule(
            "copy", (HF_EMBEDDER + "embedding_projection.weight",), 0
        ),
    }
    attn = dict(heads=v.num_heads, groups=v.num_key_value_heads, head_dim=v.head_dim)
    norms = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
             "pre_mlp_layernorm": "pre_feedforward_layernorm", "post_mlp_layernorm": "post_feedforward_layernorm",
             "self_attention.q_norm": "self_attn.q_norm", "self_attention.k_norm": "self_attn.k_norm"}  # fmt: skip
    for i in range(v.depth):
        mc, hf = f"{VISION}layers.{i}.", f"{HF_TOWER}encoder.layers.{i}."
        proj = tuple(f"{hf}self_attn.{x}_proj.linear.weight" for x in "qkv")
        rules |= {
            mc + f"{ours}.weight": Rule("copy", (f"{hf}{theirs}.weight",), None)
            for ours, theirs in norms.items()
        }
        rules |= {
            mc + "self_attention.linear_qkv.weight": Rule("qkv", proj, **attn),
            mc + "self_attention.linear_proj.weight": Rule(
                "copy", (hf + "self_attn.o_proj.linear.weight",), 1
            ),
            mc + "mlp.linear_fc1.weight": Rule(
                "glu", (hf + "mlp.gate_proj.linear.weight", hf + "mlp.up_proj.linear.weight")
            ),
            mc + "mlp.linear_fc2.weight": Rule("copy", (hf + "mlp.down_proj.linear.weight",), 1),
        }
    return rules


def vision_shapes(arch: Gemma4Arch) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every vision tower and projector tensor ``save_pretrained`` writes."""
    v = arch.vision
    h, ffn, d = v.hidden_size, v.intermediate_size, v.head_dim
    q, kv = v.num_heads * d, v.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        HF_TOWER + "patch_embedder.input_proj.weight": (h, 3 * v.patch_size**2),
        HF_TOWER + "patch_embedder.position_embedding_table": (2, v.position_embedding_size, h),
        HF_EMBEDDER + "embedding_projection.weight": (arch.text.hidden_size, h),
    }
    for i in range(v.depth):
        p = f"{HF_TOWER}encoder.layers.{i}."
        shapes |= {p + f"{n}.weight": (h,) for n in ("input_layernorm", "post_attention_layernorm",
                                                       "pre_feedforward_layernorm", "post_feedforward_layernorm")}  # fmt: skip
        shapes |= {
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "self_attn.q_proj.linear.weight": (q, h),
            p + "self_attn.k_proj.linear.weight": (kv, h),
            p + "self_attn.v_proj.linear.weight": (kv, h),
            p + "self_attn.o_proj.linear.weight": (h, q),
            p + "mlp.gate_proj.linear.weight": (ffn, h),
            p + "mlp.up_proj.linear.weight": (ffn, h),
            p + "mlp.down_proj.linear.weight": (h, ffn),
        }
    return shapes
