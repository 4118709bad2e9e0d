"""Packed-sequence layout: from a bin's samples to tokens, labels, positions, cu_seqlens and masks (numpy).

A bin is the unpadded concatenation of its samples (`input_ids`, `loss_mask`) and their lengths
(`seq_lens`). `build_packed_sequence` lays it out in a row of `pad_to` tokens:

- labels[i] = tokens[i + 1] when i + 1 is in the same sample and loss_mask[i + 1] == 1, else -100
  (so the last token of every sample and all padding get -100: no label crosses a sample boundary);
- position_ids restart at 0 for every sample; padding, if any, is one more segment with positions 0..;
- cu_seqlens are the segment boundaries (padding included), attention_mask (on request) is the
  block-diagonal causal mask [1, L, L] with True = masked (Megatron convention).

These are the one label rule (`build_labels`), position rule (`build_position_ids`, the default of the
micro-batch's `position_ids`) and block mask (`block_mask`, also the trainer's and the vision tower's) of
mmpack; the loader's collate writes its rows with them. `collate_packed` stacks rows into the layout fields
of a micro-batch with cu_seqlens over the flattened [B * L] tokens (the reference the loader is tested
against).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackedSequence:
    """One packed row of length L (numpy arrays; see the module docstring for their meaning)."""

    tokens: np.ndarray  # int64 [L]
    labels: np.ndarray  # int64 [L]
    loss_mask: np.ndarray  # float32 [L]
    position_ids: np.ndarray  # int64 [L]
    cu_seqlens: np.ndarray  # int32 [n_segments + 1]
    max_seqlen: int
    seq_lens: np.ndarray  # int32 [n_samples], real samples only
    num_real_tokens: int
    attention_mask: np.ndarray | None = None  # bool [1, L, L], True = masked

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[0])


def build_packed_sequence(
    input_ids: np.ndarray | Sequence[int],
    loss_mask: np.ndarray | Sequence[int],
    seq_lens: np.ndarray | Sequence[int],
    *,
    pad_to: int | None,
    pad_id: int,
    build_attention_mask: bool = False,
    ignore_ids: Sequence[int] = (),
) -> PackedSequence:
    """Lay out one bin as a row of `pad_to` tokens (no padding when `pad_to` is None).

    `ignore_ids` are token ids that never serve as targets whatever the loss mask says (e.g. image pads).

    Raises:
        ValueError: mismatched lengths, a non-positive sample length, or a bin longer than `pad_to`.
    """
    ids = np.asarray(input_ids).astype(np.int64, copy=False).reshape(-1)
    mask = np.asarray(loss_mask).reshape(-1)
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    total = int(lens.sum())
    if ids.shape[0] != total or mask.shape[0] != total:
        raise ValueError(
            f"input_ids ({ids.shape[0]}) and loss_mask ({mask.shape[0]}) must both have sum(seq_lens) = {total} tokens"
        )
    if lens.size and int(lens.min()) < 1:
        raise ValueError(f"seq_lens must all be >= 1, got {lens.tolist()}")
    length = total if pad_to is None else int(pad_to)
    if length < total:
        raise ValueError(f"bin of {total} tokens does not fit pad_to={length}")

    segment_lens = lens if length == total else np.append(lens, length - total)
    cu_seqlens = np.zeros(segment_lens.size + 1, dtype=np.int32)
    np.cumsum(segment_lens, out=cu_seqlens[1:])

    tokens = np.full(length, pad_id, dtype=np.int64)
    tokens[:total] = ids
    labels = build_labels(ids, mask, lens, ignore_ids=ignore_ids)
    labels = np.concatenate([labels, np.full(length - total, IGNORE_INDEX, dtype=np.int64)])
    return PackedSequence(
        tokens=tokens,
        labels=labels,
        loss_mask=(labels != IGNORE_INDEX).astype(np.float32),
        position_ids=build_position_ids(segment_lens),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(segment_lens.max()) if segment_lens.size else 0,
        seq_lens=lens.astype(np.int32),
        num_real_tokens=total,
        attention_mask=build_attention_mask_from_cu_seqlens(cu_seqlens)[None]
        if build_attention_mask
        else None,
    )


def build_labels(
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    seq_lens: np.ndarray,
    *,
    ignore_ids: Sequence[int] = (),
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Next-token labels of an unpadded bin: -100 where the next token is not a target of the same sample
    (nor one of `ignore_ids`); written into `out` (int64, len(input_ids)) when given."""
    total = int(input_ids.shape[0])
    labels = np.empty(total, dtype=np.int64) if out is None else out
    labels.fill(IGNORE_INDEX)
    if total < 2:
        return labels
    keep = loss_mask[1:] != 0
    # Position i may predict i + 1 only if i is not the last token of its sample.
    last_of_sample = np.cumsum(np.asarray(seq_lens, dtype=np.int64)) - 1
    keep[last_of_sample[last_of_sample < total - 1]] = False
    for pad in ignore_ids:
        if pad >= 0:
            keep &= input_ids[1:] != pad
    np.copyto(labels[:-1], input_ids[1:], where=keep)
    return labels


def build_position_ids(segment_lens: np.ndarray | Sequence[int]) -> np.ndarray:
    """Positions 0..n-1 inside each segment, concatenated: int64 [sum(segment_lens)]."""
    lens = np.asarray(segment_lens, dtype=np.int64)
    total = int(lens.sum())
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    return np.arange(total, dtype=np.int64) - starts


def block_mask(segment_ids: Any, *, causal: bool = True) -> Any:
    """Block-diagonal attention mask of per-token segment ids ([..., L] -> bool [..., L, L], True = masked):
    token i sees token j iff they are in one segment (and j <= i when `causal`).

    The one mask builder: numpy arrays give numpy (the loader), torch tensors give torch on their device
    (the trainer's batches without a mask, the vision tower's windows); only operations both share are used.
    """
    seen = segment_ids[..., :, None] == segment_ids[..., None, :]
    if causal:
        order = (segment_ids == segment_ids).cumsum(-1)  # 1..L along the last axis, in the array's library
        seen &= order[..., None, :] <= order[..., :, None]
    return ~seen


def segment_ids(segment_lens: np.ndarray | Sequence[int]) -> np.ndarray:
    """int64 [sum(segment_lens)]: the segment index of every token."""
    lens = np.asarray(segment_lens, dtype=np.int64)
    return np.repeat(np.arange(lens.size, dtype=np.int64), lens)


def build_attention_mask_from_cu_seqlens(cu_seqlens: np.ndarray) -> np.ndarray:
    """Block-diagonal causal mask bool [L, L], True = masked: i sees j iff j <= i in the same segment."""
    return block_mask(segment_ids(np.diff(np.asarray(cu_seqlens, dtype=np.int64))))


def collate_packed(rows: Sequence[PackedSequence]) -> dict[str, np.ndarray | int]:
    """Stack rows of equal length into a micro-batch (numpy).

    Returns tokens, labels, position_ids [B, L] int64, loss_mask [B, L] float32, cu_seqlens int32 over the
    flattened [B * L] tokens, max_seqlen, num_real_tokens, and attention_mask [B, 1, L, L] when every row has one.
    """
    if not rows:
        raise ValueError("collate_packed needs at least one row")
    length = rows[0].seq_len
    if any(r.seq_len != length for r in rows):
        raise ValueError(f"rows must share one length, got {sorted({r.seq_len for r in rows})}")
    cu = [np.zeros(1, dtype=np.int64)]
    for b, r in enumerate(rows):
        cu.append(r.cu_seqlens[1:].astype(np.int64) + b * length)
    batch: dict[str, np.ndarray | int] = {
        "tokens": np.stack([r.tokens for r in rows]),
        "labels": np.stack([r.labels for r in rows]),
        "loss_mask": np.stack([r.loss_mask for r in rows]),
        "position_ids": np.stack([r.position_ids for r in rows]),
        "cu_seqlens": np.concatenate(cu).astype(np.int32),
        "max_seqlen": max(r.max_seqlen for r in rows),
        "num_real_tokens": sum(r.num_real_tokens for r in rows),
    }
    masks = [r.attention_mask for r in rows]
    if all(m is not None for m in masks):
        batch["attention_mask"] = np.stack([m for m in masks if m is not None])
    return batch
