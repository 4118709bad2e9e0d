"""Bin packing: kernels against pure-Python references, invariants under random inputs, edge cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack.packing import binpack
from mmpack.packing.binpack import ALGORITHMS, pack_lengths
from mmpack.packing.stats import lower_bound_l2
from tests.support import reference
from tests.support.binpack_checks import assert_valid, pack

FAST = settings(max_examples=60, deadline=None)


@st.composite
def packing_inputs(draw, with_caps: bool = True):
    capacity = draw(st.integers(1, 40))
    n = draw(st.integers(0, 40))
    lengths = draw(st.lists(st.integers(1, capacity + 3), min_size=n, max_size=n))
    max_items = draw(st.one_of(st.none(), st.integers(1, 5))) if with_caps else None
    images = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)) if with_caps else None
    max_images = draw(st.one_of(st.none(), st.integers(0, 4))) if with_caps else None
    return lengths, capacity, max_items, images, max_images


@FAST
@given(packing_inputs(), st.sampled_from(ALGORITHMS))
def test_every_algorithm_gives_a_valid_deterministic_packing(inputs, algorithm):
    lengths, capacity, max_items, images, max_images = inputs
    if algorithm == "patterns" and images is not None and max_images is not None and any(images):
        with pytest.raises(ValueError, match="patterns"):
            pack(*inputs, algorithm)
        return
    first = pack(*inputs, algorithm)
    assert_valid(first, lengths, capacity, max_items, images, max_images)
    again = pack(*inputs, algorithm)
    np.testing.assert_array_equal(first.bin_ids, again.bin_ids)
    assert first.num_bins == again.num_bins and first.algorithm == again.algorithm


@FAST
@given(packing_inputs())
def test_next_fit_matches_reference(inputs):
    lengths, capacity, max_items, images, max_images = inputs
    got = pack(*inputs, "nf")
    want, num_bins = reference.next_fit(lengths, capacity, *_ref_caps(max_items, images, max_images))
    assert got.bin_ids.tolist() == want and got.num_bins == num_bins


@FAST
@given(packing_inputs())
def test_first_fit_decreasing_matches_reference(inputs):
    lengths, capacity, max_items, images, max_images = inputs
    got = pack(*inputs, "ffd")
    want, num_bins = reference.first_fit_decreasing(
        lengths, capacity, *_ref_caps(max_items, images, max_images)
    )
    assert got.bin_ids.tolist() == want and got.num_bins == num_bins


@FAST
@given(packing_inputs())
def test_best_fit_decreasing_with_caps_matches_reference(inputs):
    lengths, capacity, max_items, images, max_images = inputs
    max_items = 2 if max_items is None else max_items
    got = pack(lengths, capacity, max_items, images, max_images, "obfd")
    want, num_bins = reference.best_fit_decreasing(
        lengths, capacity, *_ref_caps(max_items, images, max_images)
    )
    assert got.num_bins == num_bins
    image_capped = images is not None and max_images is not None and any(images)
    if image_capped or max_items < len(lengths):  # otherwise the uncapped kernel runs: ties differ
        assert got.bin_ids.tolist() == want
    else:
        assert reference.bin_loads(lengths, got.bin_ids.tolist()) == reference.bin_loads(lengths, want)


@FAST
@given(packing_inputs(with_caps=False))
def test_histogram_best_fit_equals_item_best_fit(inputs):
    """Without caps, best fit over the histogram is item-by-item best fit up to ties between bins
    with equal space, so bin count and bin loads agree with the reference."""
    lengths, capacity, *_ = inputs
    got = pack(lengths, capacity, None, None, None, "obfd")
    want, num_bins = reference.best_fit_decreasing(lengths, capacity)
    assert got.num_bins == num_bins
    assert reference.bin_loads(lengths, got.bin_ids.tolist()) == reference.bin_loads(lengths, want)


@FAST
@given(packing_inputs())
def test_auto_never_uses_more_bins_than_obfd_nor_fewer_than_l2(inputs):
    lengths, capacity, *_ = inputs
    auto = pack(*inputs, "auto")
    obfd = pack(*inputs, "obfd")
    assert auto.num_bins <= obfd.num_bins
    placed = np.asarray(lengths, dtype=np.int64)[auto.bin_ids >= 0]
    assert auto.num_bins >= lower_bound_l2(placed, capacity)


def _ref_caps(max_items, images, max_images):
    return (
        reference.UNLIMITED if max_items is None else max_items,
        None if max_images is None else images,
        reference.UNLIMITED if max_images is None or images is None else max_images,
    )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize(
    ("lengths", "capacity", "expected_bins"),
    [
        ([], 8, 0),
        ([4, 4, 4, 4], 8, 2),
        ([8, 8, 8], 8, 3),
        ([9, 10, 3], 8, 1),
        ([1, 1, 1], 1, 3),
        ([2, 1], 1, 1),
        ([20], 8, 0),
    ],
    ids=[
        "empty",
        "all-equal",
        "all-full",
        "longer-than-capacity",
        "capacity-1",
        "capacity-1-reject",
        "all-rejected",
    ],
)
def test_edge_cases(algorithm, lengths, capacity, expected_bins):
    result = pack(lengths, capacity, None, None, None, algorithm)
    assert_valid(result, lengths, capacity, None, None, None)
    assert result.num_bins == expected_bins


@pytest.mark.parametrize("algorithm", ["auto", "obfd", "ffd", "nf", "patterns"])
def test_item_cap_of_one_gives_one_bin_per_item(algorithm):
    lengths = [3, 1, 2, 1]
    result = pack(lengths, 10, 1, None, None, algorithm)
    assert result.num_bins == 4
    assert sorted(result.bin_ids.tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("algorithm", ["auto", "obfd", "ffd", "nf"])
def test_item_with_too_many_images_is_rejected(algorithm):
    result = pack([2, 2, 2], 10, None, [1, 5, 2], 3, algorithm)
    assert result.bin_ids[1] == -1
    assert_valid(result, [2, 2, 2], 10, None, [1, 5, 2], 3)


@pytest.mark.parametrize("seed", [0, 3])
def test_auto_reaches_l2_where_best_fit_does_not(seed):
    # BERT-like: a quarter at full length, the rest skewed short with a long tail
    rng = np.random.default_rng(seed)
    rest = np.clip(rng.lognormal(4.6, 0.9, 15000), 5, 511).astype(np.int64)
    lengths = np.concatenate([np.full(5000, 512), rest])
    auto = pack_lengths(lengths, 512)
    obfd = pack_lengths(lengths, 512, algorithm="obfd")
    assert auto.num_bins == lower_bound_l2(lengths, 512) < obfd.num_bins
    assert auto.algorithm == "patterns"


def test_bins_lists_sorted_member_indices():
    result = pack_lengths(np.array([5, 3, 5, 3], dtype=np.int32), 8)
    assert [b.tolist() for b in result.bins()] == sorted(([0, 1], [2, 3]), key=lambda b: result.bin_ids[b[0]])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lengths": np.array([1.5]), "capacity": 4}, "integers"),
        ({"lengths": np.array([[1, 2]]), "capacity": 4}, "1-D"),
        ({"lengths": np.array([0, 2]), "capacity": 4}, ">= 1"),
        ({"lengths": np.array([1]), "capacity": 0}, "capacity"),
        ({"lengths": np.array([1]), "capacity": 4, "algorithm": "magic"}, "unknown algorithm"),
        ({"lengths": np.array([1]), "capacity": 4, "max_items_per_bin": 0}, "max_items_per_bin"),
        (
            {
                "lengths": np.array([1, 2]),
                "capacity": 4,
                "image_counts": np.array([1]),
                "max_images_per_bin": 2,
            },
            "image_counts",
        ),
        (
            {
                "lengths": np.array([1]),
                "capacity": 4,
                "image_counts": np.array([1]),
                "max_images_per_bin": 1,
                "algorithm": "patterns",
            },
            "patterns",
        ),
    ],
)
def test_bad_input_raises_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pack_lengths(**kwargs)


def test_large_capacity_falls_back_to_first_fit():
    lengths = np.array([1 << 24, 1 << 25, 3], dtype=np.int64)
    result = pack_lengths(lengths, 1 << 26)
    assert result.algorithm == "ffd" and result.num_bins == 1
    with pytest.raises(ValueError, match="capacity"):
        pack_lengths(lengths, 1 << 26, algorithm="obfd")


@FAST
@given(packing_inputs(), st.sampled_from(["auto", "patterns"]))
def test_cheap_pattern_fill_for_large_inputs_is_valid(inputs, algorithm):
    """Above the size budget the patterns use the one-or-two-filler fill; force it on small inputs."""
    lengths, capacity, max_items, *_ = inputs
    saved = binpack.AUTO_PATTERNS_BUDGET
    binpack.AUTO_PATTERNS_BUDGET = 0
    try:
        result = pack(lengths, capacity, max_items, None, None, algorithm)
        obfd = pack(lengths, capacity, max_items, None, None, "obfd")
    finally:
        binpack.AUTO_PATTERNS_BUDGET = saved
    assert_valid(result, lengths, capacity, max_items, None, None)
    if algorithm == "auto":
        assert result.num_bins <= obfd.num_bins
