"""Bidirectional attention within segments given by cu_seqlens (the vision tower's windows and images), for
megatron-core's ``SelfAttention`` as its ``core_attention``.

megatron-core's local ``DotProductAttention`` takes no cu_seqlens, so the segments would be a dense [P, P] mask
(tens of GB per layer at real image resolutions); Transformer Engine's THD attention would apply rotary
positions per segment from position 0, which is wrong for the tower's 2-D positions. Here the segments are
gathered into a [segments, heads, longest, head_dim] batch and attended with torch's
``scaled_dot_product_attention`` (flash / memory-efficient kernels on GPU): memory grows with the sum of the
squared segment lengths, not the square of their total. The segments come in ``PackedSeqParams`` with
``qkv_format="sbhd"``, so megatron-core applies the rotary angles per patch as given.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def segment_index(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather index [segments, longest] into the flat sequence, valid mask [segments, longest])."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    longest = int(lengths.max()) if len(lengths) else 0
    offsets = torch.arange(longest, device=cu_seqlens.device)
    valid = offsets[None, :] < lengths[:, None]
    index = (cu_seqlens[:-1, None].long() + offsets[None, :]).masked_fill(~valid, 0)
    return index, valid


def segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """[s, heads, d] query/key/value, attention only within each cu_seqlens segment -> [s, heads, d]."""
    index, valid = segment_index(cu_seqlens)
    q, k, v = (t[index].transpose(1, 2) for t in (query, key, value))  # [segments, heads, longest, d]
    mask = valid[:, None, None, :]  # keys of the segment only
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    out = out.transpose(1, 2)[valid]  # [s, heads, d] in segment order = the flat order
    return out


class SegmentAttention(MegatronModule):
    """``core_attention`` of megatron-core's ``SelfAttention`` over the segments of ``packed_seq_params``."""

    def __init__(
        self, config: TransformerConfig, layer_number: int, attn_mask_type: Any, attention_type: str,
        attention_dropout: float | None = None, softmax_scale: float | None = None, **_: Any,
    ) -> None:  # fmt: skip
        super().__init__(config=config)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale or 1.0 / math.sqrt(
            config.kv_channels or config.hidden_size // config.num_attention_heads
        )

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
        attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:  # fmt: skip
        if packed_seq_params is None or packed_seq_params.cu_seqlens_q is None:
            raise ValueError("SegmentAttention needs packed_seq_params with cu_seqlens_q (the segments)")
        s, b, heads, d = query.shape
        if b != 1:
            raise ValueError(f"SegmentAttention takes one flat sequence (batch 1), got batch {b}")
        if key.shape[2] != heads:  # grouped-query attention: repeat the key/value groups
            key = key.repeat_interleave(heads // key.shape[2], dim=2)
            value = value.repeat_interleave(heads // value.shape[2], dim=2)
        out = segment_attention(
            query[:, 0], key[:, 0], value[:, 0], packed_seq_params.cu_seqlens_q, scale=self.scale,
            dropout_p=self.dropout_p if self.training else 0.0,
        )  # fmt: skip
        return out.reshape(s, 1, heads * d)
