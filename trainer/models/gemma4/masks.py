"""Gemma 4's attention within each sample of a packed bin (CPU path): causal full-attention layers, and
sliding-window layers on which each image's tokens also see each other.

A packed bin holds several samples back to back (``cu_seqlens``); no token sees another sample. Within a sample,
a full-attention layer is causal; a sliding layer lets query ``q`` see key ``k`` when ``k > q - window`` and
(``k <= q`` or ``q`` and ``k`` are tokens of the same image). Images are the runs of consecutive vision tokens
(``mm_token_type_ids`` 1 or 2); pairs are only formed within a sample, so an image never spans two samples even
when two samples' images touch at their boundary. Full-attention layers stay causal inside images (bidirectional
attention on sliding layers only, as ``use_bidirectional_attention: "vision"`` reads in transformers' Gemma 4).

The samples are gathered into a [samples, heads, longest, head_dim] batch (:func:`segment_index`), so memory grows
with the sum of the squared sample lengths, not the square of the bin's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmpack.trainer.models.segment_attention import segment_index


def image_blocks(mm_token_type_ids: torch.Tensor) -> torch.Tensor:
    """[s] image number of every token of a packed bin (0, 1, ... over the bin), -1 for text: a new image starts
    at each vision token whose predecessor is text. Two samples' images touching at a sample boundary share a
    number; :func:`segment_masks` compares numbers within one sample only, so that is harmless."""
    vision = (mm_token_type_ids == 1) | (mm_token_type_ids == 2)
    starts = vision.clone()
    starts[1:] &= ~vision[:-1]
    number = torch.cumsum(starts.long(), dim=0) - 1
    return torch.where(vision, number, torch.full_like(number, -1))


def segment_masks(
    cu_seqlens: torch.Tensor, blocks: torch.Tensor | None, *, window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gather index [samples, longest], valid [samples, longest], allowed [samples, longest, longest]) of one
    layer: causal within each sample, ``window`` for a sliding layer (None: full attention), and the same-image
    pairs allowed where ``blocks`` is given (the sliding layers of a model with bidirectional image attention)."""
    index, valid = segment_index(cu_seqlens)
    longest = index.shape[1]
    pos = torch.arange(longest, device=index.device)
    q, k = pos[:, None], pos[None, :]
    allowed = (k <= q)[None].expand(index.shape[0], -1, -1)
    if blocks is not None:
        b = blocks[index].masked_fill(~valid, -1)
        allowed = allowed | ((b[:, :, None] == b[:, None, :]) & (b[:, :, None] >= 0))
    if window is not None:
        allowed = allowed & (k > q - window)[None]
    return index, valid, allowed & valid[:, None, :] & valid[:, :, None]


def packed_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
    blocks: torch.Tensor | None, *, window: int | None, scale: float,
) -> torch.Tensor:  # fmt: skip
    """[s, heads, d] query, [s, kv_heads, d] key/value -> [s, heads, d]: each token attends as
    :func:`segment_masks` allows (grouped-query keys/values repeated to the query heads)."""
    heads = query.shape[1]
    if key.shape[1] != heads:
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    index, valid, allowed = segment_masks(cu_seqlens, blocks, window=window)
    q, k, v = (t[index].transpose(1, 2) for t in (query, key, value))  # [samples, heads, longest, d]
    mask = allowed | ~valid[:, :, None]  # padded query rows see everything (dropped below), never all-masked
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)[valid]
