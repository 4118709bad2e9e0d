"""The context-parallel split of a packed micro-batch (`mmpack.packing.context_parallel`) against the slow
reference `tests.support.reference.cp_split`, and the invariants the trainer relies on: together the ranks hold every
token once, pads carry no loss, and the gathered-key mask is the per-sample causal mask."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack.packing.context_parallel import cp_attention_allowed, cp_shard, padded_cu_seqlens, split_for_cp
from mmpack.packing.layout import IGNORE_INDEX
from tests.support.reference import cp_split

segments = st.lists(st.integers(min_value=0, max_value=23), min_size=1, max_size=6)


def _cu(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@settings(max_examples=150, deadline=None)
@given(lengths=segments, cp=st.sampled_from([1, 2, 3, 4]))
def test_shard_equals_reference(lengths: list[int], cp: int) -> None:
    cu = _cu(lengths)
    held = []
    for rank in range(cp):
        shard = cp_shard(cu, cp, rank)
        assert shard.source.tolist() == cp_split(cu.tolist(), cp, rank)
        assert shard.local_cu_seqlens[-1] == shard.num_tokens
        held += [int(s) for s in shard.source if s >= 0]
    assert sorted(held) == list(range(int(cu[-1])))  # every token on exactly one rank
    padded = padded_cu_seqlens(cu, cp)
    assert all(int(n) % (2 * cp) == 0 for n in np.diff(padded))


def test_known_layout_cp2() -> None:
    """One segment of 8 tokens at CP 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2;
    a segment of 3 gets one pad."""
    cu = np.array([0, 8, 11])
    assert cp_shard(cu, 2, 0).source.tolist() == [0, 1, 6, 7, 8, -1]
    assert cp_shard(cu, 2, 1).source.tolist() == [2, 3, 4, 5, 9, 10]
    # control: a plain contiguous split (rank 0 the first half) is not this layout
    assert cp_shard(cu, 2, 0).source.tolist()[:4] != [0, 1, 2, 3]


def test_split_arrays_and_pads() -> None:
    lengths = [5, 7, 4]
    cu = _cu(lengths)
    n = int(cu[-1])
    tokens = np.arange(100, 100 + n).reshape(2, n // 2)
    labels = tokens + 1
    loss = np.ones_like(tokens, dtype=np.float32)
    positions = np.stack([np.arange(n).reshape(2, n // 2) * (a + 1) for a in range(3)])
    part = split_for_cp(tokens, labels, loss, positions, cu, cp_size=2, cp_rank=1, pad_id=7)
    src = part.shard.source
    real = src >= 0
    assert part.tokens[real].tolist() == (100 + src[real]).tolist()
    assert part.labels[real].tolist() == (101 + src[real]).tolist()
    assert part.position_ids.shape == (3, len(src))
    assert part.position_ids[2, real].tolist() == (3 * src[real]).tolist()
    assert (part.tokens[~real] == 7).all() and (part.labels[~real] == IGNORE_INDEX).all()
    assert (part.loss_mask[~real] == 0).all() and (~real).any()
    with pytest.raises(ValueError, match="cu_seqlens ends at"):
        split_for_cp(tokens, labels, loss, positions, cu[:-1], cp_size=2, cp_rank=0, pad_id=7)


@pytest.mark.parametrize("cp", [2, 3])
def test_gathered_mask_is_the_per_sample_causal_mask(cp: int) -> None:
    """Reordered by global index, rank r's mask over the gathered keys is the block-causal mask of the
    padded sequence at rank r's rows."""
    cu = _cu([6, 1, 9, 4])
    padded = padded_cu_seqlens(cu, cp).astype(np.int64)
    total = int(padded[-1])
    seg = np.searchsorted(padded, np.arange(total), side="right") - 1
    full = (seg[:, None] == seg[None, :]) & (np.arange(total)[None, :] <= np.arange(total)[:, None])
    keys = np.concatenate([cp_shard(cu, cp, r).global_index for r in range(cp)])
    for rank in range(cp):
        rows = cp_shard(cu, cp, rank).global_index
        allowed = cp_attention_allowed(cu, cp, rank)
        assert np.array_equal(allowed, full[rows][:, keys])
    with pytest.raises(ValueError, match="does not exist"):
        cp_shard(cu, 2, 2)
