"""The context-parallel split of a packed micro-batch (numpy, no torch): the one owner of which tokens a CP
rank holds.

The micro-batch is taken as one flattened THD sequence of segments (``cu_seqlens``, padding segments
included). Each segment is padded at its end to a multiple of 2 * CP and cut into 2 * CP equal chunks;
CP rank r holds chunks r and 2 * CP - 1 - r of every segment, in segment order: the load-balanced layout of
Transformer Engine's THD context parallelism (``thd_get_partitioned_indices``), in which every rank gets the
same share of causal attention work. The pads sit after the last token of their segment, so under causal
attention no real token sees them; they carry no label and no loss.

:func:`cp_shard` says, for one rank, where each of its tokens comes from; :func:`split_for_cp` applies it to
the arrays of the micro-batch (tokens, labels, loss mask, positions with any leading axes, e.g. M-RoPE's
[3, n]).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmpack.packing.layout import IGNORE_INDEX


@dataclass(frozen=True)
class CpShard:
    """The tokens CP rank ``cp_rank`` holds of a flattened micro-batch.

    ``source``: int64 [n], the index of each token in the flattened micro-batch, -1 for a pad;
    ``global_index``: int64 [n], its index in the padded sequence; ``padded_cu_seqlens``: int32 [S + 1] over
    the padded sequence (what TE's THD attention takes); ``local_cu_seqlens``: int32 [S + 1] over this
    rank's tokens (``padded_cu_seqlens / CP``)."""

    cp_size: int
    cp_rank: int
    source: np.ndarray
    global_index: np.ndarray
    padded_cu_seqlens: np.ndarray
    local_cu_seqlens: np.ndarray

    @property
    def num_tokens(self) -> int:
        return len(self.source)


def padded_cu_seqlens(cu_seqlens: np.ndarray, cp_size: int) -> np.ndarray:
    """int32 [S + 1]: segment boundaries after padding every segment to a multiple of 2 * ``cp_size``."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    if cu.ndim != 1 or len(cu) < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must be a non-decreasing 1-D array from 0, got {cu.tolist()[:8]}...")
    unit = 2 * cp_size
    lengths = -(-np.diff(cu) // unit) * unit
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def cp_shard(cu_seqlens: np.ndarray, cp_size: int, cp_rank: int) -> CpShard:
    """Which tokens of the micro-batch with segments ``cu_seqlens`` CP rank ``cp_rank`` of ``cp_size``
    holds (see the module docstring)."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"CP rank {cp_rank} of CP size {cp_size} does not exist")
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    padded = padded_cu_seqlens(cu, cp_size).astype(np.int64)
    chunk = np.diff(padded) // (2 * cp_size)  # per segment
    starts = padded[:-1]
    # the two chunks of every segment, in segment order: [first chunk, second chunk] per segment
    first = starts + cp_rank * chunk
    second = starts + (2 * cp_size - 1 - cp_rank) * chunk
    begins = np.stack([first, second], axis=1).reshape(-1)
    lengths = np.repeat(chunk, 2)
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    global_index = np.repeat(begins, lengths) + offsets
    segment = np.repeat(np.arange(len(chunk)), 2 * chunk)
    within = global_index - padded[segment]
    real = within < (cu[1:] - cu[:-1])[segment]
    source = np.where(real, cu[:-1][segment] + within, -1)
    return CpShard(
        cp_size=cp_size,
        cp_rank=cp_rank,
        source=source.astype(np.int64),
        global_index=global_index.astype(np.int64),
        padded_cu_seqlens=padded.astype(np.int32),
        local_cu_seqlens=(padded // cp_size).astype(np.int32),
    )


def take_tokens(values: np.ndarray, shard: CpShard, pad_value: float) -> np.ndarray:
    """``values`` [..., n_flat] at the shard's tokens (last axis), ``pad_value`` at its pads."""
    out = np.asarray(values)[..., np.maximum(shard.source, 0)].copy()
    out[..., shard.source < 0] = pad_value
    return out


@dataclass(frozen=True)
class CpArrays:
    """One CP rank's part of a flattened micro-batch: each array over its ``shard.num_tokens`` tokens."""

    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    position_ids: np.ndarray
    shard: CpShard


def split_for_cp(
    tokens: np.ndarray, labels: np.ndarray, loss_mask: np.ndarray, position_ids: np.ndarray,
    cu_seqlens: np.ndarray, *, cp_size: int, cp_rank: int, pad_id: int,
) -> CpArrays:  # fmt: skip
    """CP rank ``cp_rank``'s part of a micro-batch: tokens, labels, loss mask [B, L] and positions
    [..., B, L] flattened over B * L and split by :func:`cp_shard` of ``cu_seqlens`` (pads: ``pad_id``, no
    label, no loss, position 0)."""
    n = int(np.asarray(tokens).size)
    if int(np.asarray(cu_seqlens)[-1]) != n:
        raise ValueError(
            f"cu_seqlens ends at {int(np.asarray(cu_seqlens)[-1])}, the micro-batch has {n} tokens"
        )
    shard = cp_shard(cu_seqlens, cp_size, cp_rank)
    positions = np.asarray(position_ids)
    flat_positions = positions.reshape(*positions.shape[: positions.ndim - 2], n)
    return CpArrays(
        tokens=take_tokens(np.asarray(tokens).reshape(n), shard, pad_id),
        labels=take_tokens(np.asarray(labels).reshape(n), shard, IGNORE_INDEX),
        loss_mask=take_tokens(np.asarray(loss_mask).reshape(n), shard, 0),
        position_ids=take_tokens(flat_positions, shard, 0),
        shard=shard,
    )


def cp_attention_allowed(cu_seqlens: np.ndarray, cp_size: int, cp_rank: int) -> np.ndarray:
    """bool [n_local, CP * n_local]: which keys each of rank ``cp_rank``'s queries attends to, the keys
    being every rank's tokens gathered in rank order (causal within a segment, from the global indices)."""
    shards = [cp_shard(cu_seqlens, cp_size, r) for r in range(cp_size)]
    padded = shards[0].padded_cu_seqlens.astype(np.int64)
    keys = np.concatenate([s.global_index for s in shards])
    queries = shards[cp_rank].global_index
    seg_q = np.searchsorted(padded, queries, side="right") - 1
    seg_k = np.searchsorted(padded, keys, side="right") - 1
    return (seg_q[:, None] == seg_k[None, :]) & (keys[None, :] <= queries[:, None])
