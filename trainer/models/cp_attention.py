"""Causal attention of the language model under context parallelism on CPU (gloo): each CP rank holds its
chunks of every packed sample (`mmpack.packing.context_parallel`), gathers the keys and values of all CP ranks
and attends with the mask of its queries over the gathered keys (per sample, causal by global token index),
which the trainer passes as the attention mask.

megatron-core's local ``DotProductAttention`` refuses context parallelism (only Transformer Engine's attention
implements it, on GPU); this all-gather attention is the CPU stand-in that lets the whole CP path run in
tests. The gather's backward sums the key/value gradients of all ranks and hands each rank its own part (a
reduce-scatter), so the gradients reach the rank that owns the tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from mmpack.trainer.models.segment_attention import SegmentAttention


class _GatherSequence(torch.autograd.Function):
    """All-gather along the first (sequence) axis over a group; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return summed.chunk(size, dim=0)[rank].contiguous(), None


def gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` [s, ...] of every rank of ``group`` concatenated in rank order -> [size * s, ...]."""
    return _GatherSequence.apply(x, group)


class GatheredKVAttention(SegmentAttention):
    """``core_attention`` of megatron-core's ``SelfAttention`` under CP on CPU: [s, 1, heads, d] local
    queries over the CP group's gathered keys and values; ``attention_mask`` [1, 1, s, CP * s], True =
    masked. Its settings (dropout, softmax scale) are the packed-segment attention's."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
        attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None,
    ) -> torch.Tensor:  # fmt: skip
        s, b, heads, d = query.shape
        group = ps.get_context_parallel_group()
        key, value = gather_sequence(key, group), gather_sequence(value, group)
        if attention_mask is None or tuple(attention_mask.shape[-2:]) != (s, key.shape[0]):
            raise ValueError(
                f"context-parallel attention needs the mask of {s} queries over {key.shape[0]} gathered keys"
            )
        if key.shape[2] != heads:  # grouped-query attention: repeat the key/value groups
            key = key.repeat_interleave(heads // key.shape[2], dim=2)
            value = value.repeat_interleave(heads // value.shape[2], dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=~attention_mask, scale=self.scale,
            dropout_p=self.dropout_p if self.training else 0.0,
        )  # fmt: skip
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)
