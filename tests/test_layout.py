"""Packed-sequence layout: property tests against the reference and the invariants of DESIGN.md."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack.packing.chat import ChatTemplate, Conversation, tokenize_conversation
from mmpack.packing.layout import (
    IGNORE_INDEX,
    PackedSequence,
    build_attention_mask_from_cu_seqlens,
    build_packed_sequence,
    collate_packed,
)
from mmpack.packing.tokenizer import ByteTokenizer
from tests.support.reference_layout import reference_packed_sequence

PAD = 9999


@st.composite
def bins(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, list[int], int]:
    seq_lens = draw(st.lists(st.integers(1, 12), min_size=0, max_size=6))
    total = sum(seq_lens)
    ids = np.asarray(draw(st.lists(st.integers(0, 500), min_size=total, max_size=total)), dtype=np.uint32)
    mask = np.asarray(draw(st.lists(st.integers(0, 1), min_size=total, max_size=total)), dtype=np.uint8)
    pad_to = total + draw(st.integers(0, 7))
    return ids, mask, seq_lens, pad_to


def _owner(seq_lens: list[int], length: int) -> np.ndarray:
    """Sample index per position; padding gets -1."""
    owner = np.full(length, -1)
    owner[: sum(seq_lens)] = np.repeat(np.arange(len(seq_lens)), seq_lens)
    return owner


@settings(max_examples=300, deadline=None)
@given(bins(), st.booleans())
def test_matches_reference(case: tuple[np.ndarray, np.ndarray, list[int], int], with_mask: bool) -> None:
    ids, mask, seq_lens, pad_to = case
    got = build_packed_sequence(
        ids, mask, seq_lens, pad_to=pad_to, pad_id=PAD, build_attention_mask=with_mask
    )
    ref = reference_packed_sequence(ids.tolist(), mask.tolist(), seq_lens, pad_to, PAD)
    assert got.tokens.dtype == np.int64 and got.tokens.tolist() == ref["tokens"]
    assert got.labels.dtype == np.int64 and got.labels.tolist() == ref["labels"]
    assert got.loss_mask.dtype == np.float32 and got.loss_mask.tolist() == ref["loss_mask"]
    assert got.position_ids.dtype == np.int64 and got.position_ids.tolist() == ref["position_ids"]
    assert got.cu_seqlens.dtype == np.int32 and got.cu_seqlens.tolist() == ref["cu_seqlens"]
    assert got.max_seqlen == ref["max_seqlen"]
    assert got.num_real_tokens == sum(seq_lens) and got.seq_lens.tolist() == seq_lens
    if with_mask:
        assert got.attention_mask is not None and got.attention_mask.shape == (1, pad_to, pad_to)
        assert (
            got.attention_mask.dtype == np.bool_ and got.attention_mask[0].tolist() == ref["attention_mask"]
        )
    else:
        assert got.attention_mask is None


@settings(max_examples=300, deadline=None)
@given(bins())
def test_invariants(case: tuple[np.ndarray, np.ndarray, list[int], int]) -> None:
    ids, mask, seq_lens, pad_to = case
    got = build_packed_sequence(ids, mask, seq_lens, pad_to=pad_to, pad_id=PAD, build_attention_mask=True)
    owner = _owner(seq_lens, pad_to)
    starts = np.cumsum([0, *seq_lens])[:-1]
    # positions restart at 0 for every sample and count up inside it
    for s, n in zip(starts, seq_lens):
        assert got.position_ids[s : s + n].tolist() == list(range(n))
    # no label crosses a sample boundary; every label is the next token of the same sample
    for i in np.flatnonzero(got.labels != IGNORE_INDEX):
        assert owner[i] >= 0 and i + 1 < pad_to and owner[i + 1] == owner[i]
        assert got.labels[i] == got.tokens[i + 1] and mask[i + 1] == 1
    for s, n in zip(starts, seq_lens):
        assert got.labels[s + n - 1] == IGNORE_INDEX
    # every target token of the input (except each sample's first token) is predicted exactly once
    expected_targets = int(mask.sum()) - int(sum(mask[s] for s in starts))
    assert int(got.loss_mask.sum()) == expected_targets
    # the mask lets a token see exactly the earlier tokens (and itself) of its own sample
    i, j = np.meshgrid(np.arange(pad_to), np.arange(pad_to), indexing="ij")
    visible = (owner[i] == owner[j]) & (j <= i)
    assert np.array_equal(~got.attention_mask[0], visible)
    # cu_seqlens delimit exactly the mask's diagonal blocks
    cu = got.cu_seqlens
    assert cu[0] == 0 and cu[-1] == pad_to and (np.diff(cu) > 0).all()
    assert np.array_equal(build_attention_mask_from_cu_seqlens(cu), got.attention_mask[0])
    for a, b in itertools.pairwise(cu):
        assert len(set(owner[a:b].tolist())) == 1
        assert got.position_ids[a:b].tolist() == list(range(b - a))
    assert got.max_seqlen == int(np.diff(cu).max(initial=0))


@settings(max_examples=100, deadline=None)
@given(bins())
def test_padding(case: tuple[np.ndarray, np.ndarray, list[int], int]) -> None:
    ids, mask, seq_lens, pad_to = case
    total = sum(seq_lens)
    got = build_packed_sequence(ids, mask, seq_lens, pad_to=pad_to, pad_id=PAD)
    pad = pad_to - total
    assert (got.tokens[total:] == PAD).all() and (got.labels[total:] == IGNORE_INDEX).all()
    assert (got.loss_mask[total:] == 0).all()
    assert got.position_ids[total:].tolist() == list(range(pad))
    # padding is its own segment, present only when there is padding
    assert len(got.cu_seqlens) == len(seq_lens) + 1 + (pad > 0)
    unpadded = build_packed_sequence(ids, mask, seq_lens, pad_to=None, pad_id=PAD)
    assert unpadded.seq_len == total and unpadded.tokens.tolist() == got.tokens[:total].tolist()
    assert unpadded.labels.tolist() == got.labels[:total].tolist()


def test_small_example_by_hand() -> None:
    got = build_packed_sequence([5, 6, 7, 8, 9], [0, 1, 1, 0, 1], [3, 2], pad_to=7, pad_id=0)
    assert got.tokens.tolist() == [5, 6, 7, 8, 9, 0, 0]
    assert got.labels.tolist() == [6, 7, -100, 9, -100, -100, -100]
    assert got.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert got.cu_seqlens.tolist() == [0, 3, 5, 7] and got.max_seqlen == 3


def test_image_pads_carry_no_loss() -> None:
    tok = ByteTokenizer()
    image_pad = tok.special_ids["image_pad"]
    samples = [
        tokenize_conversation(
            Conversation(messages=(("user", "<image>Hi"), ("assistant", "Cat<image>!")), images=("a", "b")),
            tok,
            [3, 2],
            ChatTemplate(),
        ),
        tokenize_conversation(
            Conversation(messages=(("user", "What?"), ("assistant", "A dog."))), tok, [], ChatTemplate()
        ),
    ]
    ids = np.concatenate([s.input_ids for s in samples])
    mask = np.concatenate([s.loss_mask for s in samples])
    got = build_packed_sequence(
        ids, mask, [len(s) for s in samples], pad_to=len(ids) + 5, pad_id=tok.special_ids["pad"]
    )
    assert not (got.labels == image_pad).any()
    pads = np.flatnonzero(got.tokens == image_pad)
    assert pads.size == 5 and not got.loss_mask[pads - 1].any()
    # ignore_ids removes such targets even when a loss mask wrongly marks them
    forced = build_packed_sequence(
        ids, np.ones_like(mask), [len(ids)], pad_to=None, pad_id=0, ignore_ids=[image_pad]
    )
    assert (
        not (forced.labels == image_pad).any() and (forced.labels != IGNORE_INDEX).sum() == len(ids) - 1 - 5
    )


def test_errors() -> None:
    with pytest.raises(ValueError, match="sum"):
        build_packed_sequence([1, 2, 3], [1, 1, 1], [2], pad_to=4, pad_id=0)
    with pytest.raises(ValueError, match="sum"):
        build_packed_sequence([1, 2], [1, 1, 1], [2], pad_to=4, pad_id=0)
    with pytest.raises(ValueError, match=">= 1"):
        build_packed_sequence([1, 2], [1, 1], [2, 0], pad_to=4, pad_id=0)
    with pytest.raises(ValueError, match="does not fit"):
        build_packed_sequence([1, 2, 3], [1, 1, 1], [3], pad_to=2, pad_id=0)


def test_empty_bin_is_all_padding() -> None:
    got = build_packed_sequence([], [], [], pad_to=4, pad_id=7, build_attention_mask=True)
    assert got.tokens.tolist() == [7] * 4 and got.cu_seqlens.tolist() == [0, 4] and got.num_real_tokens == 0
    assert (got.labels == IGNORE_INDEX).all() and got.attention_mask is not None


@settings(max_examples=100, deadline=None)
@given(st.lists(bins(), min_size=1, max_size=4), st.integers(0, 5))
def test_collate(rows: list[tuple[np.ndarray, np.ndarray, list[int], int]], extra: int) -> None:
    length = max(pad_to for *_, pad_to in rows) + extra
    packed: list[PackedSequence] = [
        build_packed_sequence(ids, mask, lens, pad_to=length, pad_id=PAD, build_attention_mask=True)
        for ids, mask, lens, _ in rows
    ]
    batch = collate_packed(packed)
    b = len(rows)
    for key in ("tokens", "labels", "position_ids"):
        arr = batch[key]
        assert isinstance(arr, np.ndarray) and arr.shape == (b, length) and arr.dtype == np.int64
    assert isinstance(batch["loss_mask"], np.ndarray) and batch["loss_mask"].dtype == np.float32
    # cu_seqlens over the flattened batch: each row's segments, shifted by its offset
    segments = [n for r in packed for n in np.diff(r.cu_seqlens).tolist()]
    cu = batch["cu_seqlens"]
    assert isinstance(cu, np.ndarray) and cu.dtype == np.int32
    assert cu.tolist() == np.cumsum([0, *segments]).tolist()
    if length:  # every row boundary is a segment boundary
        assert set(range(0, b * length + 1, length)) <= set(cu.tolist())
    assert batch["max_seqlen"] == max(segments, default=0)
    assert batch["num_real_tokens"] == sum(sum(lens) for _, _, lens, _ in rows)
    mask = batch["attention_mask"]
    assert isinstance(mask, np.ndarray) and mask.shape == (b, 1, length, length)
    # flattened positions restart at each cu_seqlens boundary
    flat_pos = np.asarray(batch["position_ids"]).reshape(-1)
    for a, e in itertools.pairwise(cu):
        assert flat_pos[a:e].tolist() == list(range(e - a))


def test_collate_errors_and_optional_mask() -> None:
    a = build_packed_sequence([1, 2], [0, 1], [2], pad_to=4, pad_id=0)
    b = build_packed_sequence([1, 2], [0, 1], [2], pad_to=5, pad_id=0)
    with pytest.raises(ValueError, match="one length"):
        collate_packed([a, b])
    with pytest.raises(ValueError):
        collate_packed([])
    assert "attention_mask" not in collate_packed([a, a])
