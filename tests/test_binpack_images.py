"""Image-capped packing: "imagefit" against its reference, the two-dimensional lower bound against
exhaustive search, and "auto" near the bound where length-ordered best fit is far from it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack.packing.binpack import pack_lengths
from mmpack.packing.stats import lower_bound_images, lower_bound_l2
from tests.support import reference
from tests.support.binpack_checks import assert_valid, pack

FAST = settings(max_examples=60, deadline=None)


@st.composite
def capped_inputs(draw, max_n: int = 40):
    capacity = draw(st.integers(1, 40))
    n = draw(st.integers(0, max_n))
    lengths = draw(st.lists(st.integers(1, capacity + 3), min_size=n, max_size=n))
    images = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    max_items = draw(st.one_of(st.none(), st.integers(1, 5)))
    max_images = draw(st.integers(0, 5))
    return lengths, capacity, max_items, images, max_images


@FAST
@given(capped_inputs())
def test_imagefit_matches_reference(inputs):
    lengths, capacity, max_items, images, max_images = inputs
    got = pack(*inputs, "imagefit")
    assert_valid(got, lengths, capacity, max_items, images, max_images)
    if any(m <= max_images and m > 0 for m in images):  # the image-capped path (else plain best fit)
        want, num_bins = reference.image_fit(
            lengths, capacity, reference.UNLIMITED if max_items is None else max_items, images, max_images
        )
        assert got.bin_ids.tolist() == want and got.num_bins == num_bins


@FAST
@given(capped_inputs(max_n=7))
def test_two_dimensional_bound_never_exceeds_the_optimum(inputs):
    lengths, capacity, max_items, images, max_images = inputs
    optimum = reference.optimal_bins(
        lengths, capacity, images, max_images, reference.UNLIMITED if max_items is None else max_items
    )
    bound = lower_bound_images(
        np.array(lengths, dtype=np.int64), np.array(images), capacity, max_images, max_items
    )
    assert bound <= optimum
    for algorithm in ("auto", "imagefit", "obfd"):
        assert pack(*inputs, algorithm).num_bins >= optimum


@FAST
@given(capped_inputs())
def test_auto_with_image_cap_never_worse_than_obfd(inputs):
    auto = pack(*inputs, "auto")
    assert auto.num_bins <= pack(*inputs, "obfd").num_bins
    lengths, capacity, max_items, images, max_images = inputs
    assert auto.num_bins >= lower_bound_images(
        np.array(lengths, dtype=np.int64), np.array(images), capacity, max_images, max_items
    )


def test_long_item_bound_counts_image_room_full_length_samples_cannot_use():
    # 4 full-length samples with no images, 4 short ones with 2 images each, cap 2: the short ones need
    # 4 bins of their own. L2 on tokens gives 4 + ceil(4/10) = 5, images alone ceil(8/2) = 4.
    lengths, images = [10] * 4 + [1] * 4, [0] * 4 + [2] * 4
    bound = lower_bound_images(np.array(lengths), np.array(images), 10, 2)
    assert lower_bound_l2(np.array(lengths), 10) == 5
    assert bound == reference.optimal_bins(lengths, 10, images, 2) == 8
    assert pack(lengths, 10, None, images, 2, "auto").num_bins == 8


@pytest.mark.parametrize(
    ("lengths", "images", "max_images", "expected_bins"),
    [
        ([], [], 2, 0),
        ([3, 3, 3], [1, 1, 1], 0, 0),  # cap 0: every sample with an image is rejected
        ([3, 3, 3], [0, 0, 0], 0, 1),
        ([3, 3, 3], [5, 1, 1], 2, 1),  # over the cap: rejected
        ([1, 1, 1, 1], [1, 1, 1, 1], 1, 4),
        ([12, 3], [1, 1], 4, 1),  # longer than the capacity: rejected
    ],
    ids=["empty", "cap-0", "cap-0-no-images", "too-many-images", "cap-1", "over-capacity"],
)
def test_imagefit_edge_cases(lengths, images, max_images, expected_bins):
    for algorithm in ("imagefit", "auto"):
        result = pack(lengths, 10, None, images, max_images, algorithm)
        assert_valid(result, lengths, 10, None, images, max_images)
        assert result.num_bins == expected_bins


@pytest.mark.parametrize("max_images", [2, 4, 8])
def test_auto_reaches_the_two_dimensional_bound_where_length_order_does_not(max_images):
    """Poisson(0.7) images on lognormal lengths: best fit by length loses bins to the cap; "auto" must
    be within 0.5% of the bound (the control shows length-ordered best fit is not, at caps 2 and 4)."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.5, 0.9, 30_000), 1, 4096).astype(np.int64)
    images = rng.poisson(0.7, len(lengths)).astype(np.int64)
    auto = pack_lengths(lengths, 4096, image_counts=images, max_images_per_bin=max_images)
    assert_valid(auto, lengths, 4096, None, images, max_images)
    bound = lower_bound_images(lengths, images, 4096, max_images)
    assert auto.algorithm == "imagefit" and auto.num_bins <= bound * 1.005
    by_length = pack_lengths(
        lengths, 4096, algorithm="obfd", image_counts=images, max_images_per_bin=max_images
    )
    if max_images <= 4:
        assert by_length.num_bins > bound * 1.05


@FAST
@given(
    st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 3), st.floats(-1, 5), st.integers(1, 3)), max_size=5
    ),
    st.integers(0, 12),
    st.integers(0, 4),
    st.integers(0, 4),
)
def test_best_pattern_kernel_matches_enumeration(classes, capacity_units, max_images, max_items):
    from mmpack.packing._bound_kernels import best_pattern_kernel

    units, images, values, counts = (np.array([c[i] for c in classes]) for i in range(4))
    value, pattern = best_pattern_kernel(
        units.astype(np.int64),
        images.astype(np.int64),
        values.astype(np.float64),
        counts.astype(np.int64),
        capacity_units,
        max_images,
        max_items,
    )
    want = reference.best_pattern(
        units.tolist(),
        images.tolist(),
        values.tolist(),
        counts.tolist(),
        capacity_units,
        max_images,
        max_items,
    )
    assert value == pytest.approx(want)
    # the returned content is feasible and worth the value
    assert np.all(pattern <= np.maximum(counts, 0)) and np.all(pattern >= 0)
    assert pattern @ units <= capacity_units and pattern @ images <= max_images
    assert max_items == 0 or pattern.sum() <= max_items
    assert pattern @ np.maximum(values, 0) == pytest.approx(value)


@settings(max_examples=25, deadline=None)
@given(capped_inputs(max_n=7))
def test_lp_bound_never_exceeds_the_optimum(inputs):
    from mmpack.packing.stats import lower_bound_images_lp

    lengths, capacity, max_items, images, max_images = inputs
    optimum = reference.optimal_bins(
        lengths, capacity, images, max_images, reference.UNLIMITED if max_items is None else max_items
    )
    bound = lower_bound_images_lp(
        np.array(lengths, dtype=np.int64), np.array(images), capacity, max_images, max_items, length_units=16
    )
    assert bound <= optimum


@pytest.mark.parametrize(
    ("lengths", "images", "max_images", "optimum"),
    [
        ([4, 1, 1, 8, 2, 6, 9], [3, 1, 0, 1, 3, 2, 0], 3, 5),
        ([3, 9, 3, 7, 6], [3, 2, 3, 3, 2], 4, 5),
        ([10, 3, 6, 2, 2, 7], [0, 2, 3, 0, 2, 1], 4, 4),
    ],
)
def test_lp_bound_reaches_the_optimum_where_the_simple_bound_does_not(lengths, images, max_images, optimum):
    """Found by search over small instances (capacity 10): the two dimensions interact; the control is
    `lower_bound_images`, one bin short."""
    from mmpack.packing.stats import image_cap_lp, lower_bound_images_lp

    assert reference.optimal_bins(lengths, 10, images, max_images) == optimum
    assert lower_bound_images(np.array(lengths), np.array(images), 10, max_images) == optimum - 1
    assert (
        lower_bound_images_lp(np.array(lengths), np.array(images), 10, max_images, length_units=10) == optimum
    )
    farley, master = image_cap_lp(np.array(lengths), np.array(images), 10, max_images, length_units=10)
    assert farley == pytest.approx(master)  # converged: the Farley bound equals the LP optimum
