"""The bin-packing tests' call of `pack_lengths` from plain lists and the check of a packing's invariants
(every placeable item in exactly one bin, no bin over its token, item or image caps)."""

from __future__ import annotations

import numpy as np

from mmpack.packing.binpack import PackResult, pack_lengths


def pack(lengths, capacity, max_items, images, max_images, algorithm):  # type: ignore[no-untyped-def]
    return pack_lengths(
        np.asarray(lengths, dtype=np.int64),
        capacity,
        algorithm=algorithm,
        max_items_per_bin=max_items,
        image_counts=None if images is None else np.asarray(images, dtype=np.int64),
        max_images_per_bin=max_images,
    )


def assert_valid(result: PackResult, lengths, capacity, max_items, images, max_images):  # type: ignore[no-untyped-def]
    lengths = np.asarray(lengths, dtype=np.int64)
    images_arr = np.zeros(len(lengths), np.int64) if images is None else np.asarray(images, np.int64)
    image_cap = max_images if (images is not None and max_images is not None) else None
    bin_ids = result.bin_ids
    assert bin_ids.dtype == np.int64 and bin_ids.shape == lengths.shape
    unplaceable = (lengths > capacity) | (images_arr > (image_cap if image_cap is not None else 1 << 62))
    np.testing.assert_array_equal(bin_ids == -1, unplaceable)
    placed = bin_ids >= 0
    if not placed.any():
        assert result.num_bins == 0
        return
    # bins numbered 0..num_bins-1, none empty, every placed item in exactly one bin
    assert set(np.unique(bin_ids[placed]).tolist()) == set(range(result.num_bins))
    bins = result.bins()
    assert len(bins) == result.num_bins
    flat = np.concatenate(bins)
    assert sorted(flat.tolist()) == np.flatnonzero(placed).tolist()
    for b, members in enumerate(bins):
        assert np.all(np.diff(members) > 0)
        assert np.all(bin_ids[members] == b)
        assert lengths[members].sum() <= capacity
        if max_items is not None:
            assert len(members) <= max_items
        if image_cap is not None:
            assert images_arr[members].sum() <= image_cap
