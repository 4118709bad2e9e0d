"""Lower bounds and packing statistics."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mmpack.packing.stats as stats
from mmpack.packing.binpack import pack_lengths
from mmpack.packing.stats import (
    lower_bound_item_cap,
    lower_bound_l1,
    lower_bound_l2,
    lower_bound_l2_from_counts,
    packing_stats,
)
from tests.support import reference

FAST = settings(max_examples=80, deadline=None)


@st.composite
def lengths_and_capacity(draw):
    capacity = draw(st.integers(1, 60))
    lengths = draw(st.lists(st.integers(1, capacity + 5), max_size=40))
    return lengths, capacity


@FAST
@given(lengths_and_capacity())
def test_bounds_match_reference(inputs):
    lengths, capacity = inputs
    array = np.asarray(lengths, dtype=np.int64)
    assert lower_bound_l1(array, capacity) == reference.lower_bound_l1(lengths, capacity)
    assert lower_bound_l2(array, capacity) == reference.lower_bound_l2(lengths, capacity)


@FAST
@given(lengths_and_capacity())
def test_sorted_l2_path_equals_histogram_path(inputs):
    lengths, capacity = inputs
    array = np.asarray(lengths, dtype=np.int64)
    by_histogram = lower_bound_l2(array, capacity)
    saved = stats._HISTOGRAM_CAPACITY_LIMIT
    stats._HISTOGRAM_CAPACITY_LIMIT = 0  # force the path used for very large capacities
    try:
        assert lower_bound_l2(array, capacity) == by_histogram
    finally:
        stats._HISTOGRAM_CAPACITY_LIMIT = saved


@FAST
@given(lengths_and_capacity(), st.sampled_from(["obfd", "ffd", "nf", "auto"]))
def test_bounds_are_below_every_packing(inputs, algorithm):
    lengths, capacity = inputs
    array = np.asarray(lengths, dtype=np.int64)
    result = pack_lengths(array, capacity, algorithm=algorithm)
    l1, l2 = lower_bound_l1(array, capacity), lower_bound_l2(array, capacity)
    assert l1 <= l2 <= result.num_bins


@FAST
@given(lengths_and_capacity(), st.integers(1, 4), st.sampled_from(["obfd", "ffd", "nf", "auto"]))
def test_item_cap_bound_matches_reference_and_is_below_capped_packings(inputs, max_items, algorithm):
    lengths, capacity = inputs
    array = np.asarray(lengths, dtype=np.int64)
    bound = lower_bound_item_cap(array, capacity, max_items)
    assert bound == reference.lower_bound_item_cap(lengths, capacity, max_items)
    assert bound <= pack_lengths(array, capacity, algorithm=algorithm, max_items_per_bin=max_items).num_bins


def test_l2_beats_l1_when_big_items_cannot_share():
    # three items of 6 in bins of 10: L1 = 2 but no two share a bin
    assert lower_bound_l1(np.array([6, 6, 6]), 10) == 2
    assert lower_bound_l2(np.array([6, 6, 6]), 10) == 3
    counts = np.bincount([6, 6, 6], minlength=11)
    assert lower_bound_l2_from_counts(counts, 10) == 3


def test_packing_stats_on_a_known_packing():
    lengths = np.array([6, 4, 5, 5, 3, 20], dtype=np.int64)
    bin_ids = np.array([0, 0, 1, 1, 2, -1], dtype=np.int64)
    images = np.array([1, 0, 2, 0, 0, 4])
    result = packing_stats(lengths, bin_ids, 10, image_counts=images)
    json.dumps(result, allow_nan=False)
    assert result["num_samples"] == 5 and result["num_rejected"] == 1
    assert result["num_bins"] == 3 and result["capacity"] == 10
    assert result["total_tokens"] == 23 and result["padding_tokens"] == 7
    assert result["fill_efficiency"] == pytest.approx(23 / 30)
    assert result["lower_bound_bins"] == 3 and result["l2_lower_bound_bins"] == 3
    assert result["padding_compression"] == pytest.approx((50 - 23) / 7)
    assert result["samples_per_bin"] == {"mean": pytest.approx(5 / 3), "p50": 2.0, "max": 2.0}
    assert result["images_per_bin"] == {"mean": 1.0, "max": 2.0}
    assert result["fill_histogram"] == {"0-50": 1, "50-70": 0, "70-85": 0, "85-95": 0, "95-100": 2}


@FAST
@given(lengths_and_capacity())
def test_packing_stats_invariants(inputs):
    lengths, capacity = inputs
    array = np.asarray(lengths, dtype=np.int64)
    result = packing_stats(array, pack_lengths(array, capacity).bin_ids, capacity)
    json.dumps(result, allow_nan=False)
    assert sum(result["fill_histogram"].values()) == result["num_bins"]
    assert result["num_samples"] + result["num_rejected"] == len(lengths)
    assert result["lower_bound_bins"] <= result["l2_lower_bound_bins"] <= result["num_bins"]
    if result["num_bins"]:
        assert 0 < result["fill_efficiency"] <= 1
        assert result["samples_per_bin"]["max"] >= result["samples_per_bin"]["mean"] >= 1


def test_packing_stats_no_padding_and_empty():
    full = packing_stats(np.array([4, 4]), np.array([0, 1]), 4)
    assert full["padding_compression"] is None and full["fill_efficiency"] == 1.0
    empty = packing_stats(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 4)
    assert empty["num_bins"] == 0 and empty["fill_efficiency"] == 0.0
    json.dumps(empty, allow_nan=False)


@pytest.mark.parametrize(
    ("lengths", "bin_ids", "message"),
    [
        ([6, 6], [0, 0], "more than capacity"),
        ([1, 2], [0], "equal length"),
        ([1], [-2], ">= -1"),
    ],
)
def test_packing_stats_rejects_invalid_packings(lengths, bin_ids, message):
    with pytest.raises(ValueError, match=message):
        packing_stats(np.array(lengths), np.array(bin_ids), 10)


def test_caps_bound_uses_the_item_cap_bound() -> None:
    # two full bins, then four 1-token items two per bin: 4 bins, where L2 alone says 3
    lengths = np.array([10, 10, 1, 1, 1, 1])
    assert stats.lower_bound_l2(lengths, 10) == 3  # control: the weaker bound
    assert stats.lower_bound_caps(lengths, 10, max_items=2) == 4
    assert stats.lower_bound_caps(lengths, 10) == 3
    images = np.array([0, 0, 2, 2, 2, 2])
    assert stats.lower_bound_caps(lengths, 10, image_counts=images, max_images=2) == 6
    # items over the image cap are rejects (pack_lengths gives them bin -1): not counted
    assert stats.lower_bound_caps(lengths, 10, image_counts=images + 1, max_images=2) == 2
    assert (
        stats.lower_bound_caps(np.array([11, 5]), 10, max_items=1) == 1
    )  # items that do not fit are left out


@given(lengths_and_capacity(), st.integers(1, 4))
@FAST
def test_caps_bound_is_below_every_capped_packing(inputs, max_items) -> None:
    lengths, capacity = inputs
    array = np.array(lengths, dtype=np.int64)
    bound = stats.lower_bound_caps(array, capacity, max_items=max_items)
    fits = [x for x in lengths if x <= capacity]
    assert bound == max(
        lower_bound_l2(np.array(fits, dtype=np.int64), capacity),
        reference.lower_bound_item_cap(fits, capacity, max_items),
    )
    bin_ids = pack_lengths(array, capacity, algorithm="obfd", max_items_per_bin=max_items).bin_ids
    assert bound <= len(set(bin_ids[bin_ids >= 0].tolist()))
