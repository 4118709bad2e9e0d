"""Pattern packing: the gap-filling kernels against brute force, and pattern bookkeeping."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack.packing import _pattern_kernels as kernels
from tests.support import reference

FAST = settings(max_examples=80, deadline=None)


@st.composite
def fill_problems(draw):
    gap = draw(st.integers(1, 24))
    counts = draw(st.dictionaries(st.integers(1, 24), st.integers(1, 3), max_size=6))
    max_fillers = draw(st.integers(1, 5))
    return counts, gap, max_fillers


def _histogram(counts: dict[int, int], size: int) -> np.ndarray:
    histogram = np.zeros(size + 1, dtype=np.int64)
    for length, count in counts.items():
        histogram[length] = count
    return histogram


def _chosen(
    used: np.ndarray, num_used: int, histogram: np.ndarray, gap: int, max_fillers: int
) -> tuple[int, int]:
    fill = items = 0
    for length, copies in used[:num_used]:
        assert copies >= 1 and copies <= histogram[length]
        fill += int(length * copies)
        items += int(copies)
    assert fill <= gap and items <= max_fillers
    return fill, items


@FAST
@given(fill_problems())
def test_fewest_item_fill_is_fullest_with_fewest_items(problem):
    counts, gap, max_fillers = problem
    histogram = _histogram(counts, 24)
    used = np.zeros((25, 2), dtype=np.int64)
    num_used = kernels._best_fill(histogram, gap, 24, max_fillers, np.zeros(25, dtype=np.int64), used)
    fill, fewest, _ = reference.best_fill(counts, gap, max_fillers)
    assert _chosen(used, num_used, histogram, gap, max_fillers) == (fill, fewest)


@FAST
@given(fill_problems())
def test_capped_fill_is_fullest_with_most_items(problem):
    counts, gap, max_fillers = problem
    histogram = _histogram(counts, 24)
    used = np.zeros((25, 2), dtype=np.int64)
    num_used = kernels._best_fill_capped(histogram, gap, 24, max_fillers, used)
    fill, _, most = reference.best_fill(counts, gap, max_fillers)
    assert _chosen(used, num_used, histogram, gap, max_fillers) == (fill, most)


@FAST
@given(fill_problems())
def test_pair_fill_is_feasible_and_at_least_the_best_single_item(problem):
    counts, gap, max_fillers = problem
    histogram = _histogram(counts, 24)
    used = np.zeros((25, 2), dtype=np.int64)
    num_used = kernels._pair_fill(histogram, gap, 24, max_fillers, np.zeros(25, dtype=np.int64), used)
    fill, _ = _chosen(used, num_used, histogram, gap, max_fillers)
    assert fill >= max([s for s in counts if s <= gap], default=0)
    if max_fillers >= 2:
        assert fill >= reference.best_fill(counts, gap, 2)[0]


@FAST
@given(
    st.integers(1, 30),
    st.lists(st.integers(0, 4), min_size=30, max_size=30),
    st.sampled_from([1 << 62, 1, 2, 3, 5]),
    st.booleans(),
    st.sampled_from([0, 50, 1 << 40]),
)
def test_patterns_use_every_item_once_and_fit(capacity, raw_counts, max_items, cheap, work_budget):
    counts = np.zeros(capacity + 1, dtype=np.int64)
    counts[1:] = raw_counts[:capacity]
    starts, lengths, copies, multiplicity = kernels.pattern_greedy_kernel(
        counts, capacity, max_items, capacity // 2, cheap, work_budget
    )
    used = np.zeros_like(counts)
    for p in range(len(multiplicity)):
        members = slice(starts[p], starts[p + 1])
        assert multiplicity[p] >= 1
        assert int((lengths[members] * copies[members]).sum()) <= capacity
        assert int(copies[members].sum()) <= max_items
        np.add.at(used, lengths[members], copies[members] * multiplicity[p])
    np.testing.assert_array_equal(used, counts)
