"""Packing efficiency statistics and lower bounds on the number of bins.

Lower bounds count only items that fit a bin (length <= capacity):
L1 = ceil(total / capacity); L2 is the Martello-Toth bound, computed over the length histogram.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FILL_BUCKETS: tuple[tuple[str, float, float], ...] = (
    ("0-50", 0.0, 0.50),
    ("50-70", 0.50, 0.70),
    ("70-85", 0.70, 0.85),
    ("85-95", 0.85, 0.95),
    ("95-100", 0.95, 1.0 + 1e-12),
)
_HISTOGRAM_CAPACITY_LIMIT = 1 << 24
_DEBUG = True


def _positive_int(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _fitting_lengths(lengths: np.ndarray, capacity: int) -> np.ndarray:
    array = np.asarray(lengths)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"lengths must be a 1-D integer array, got {array.dtype} {array.shape}")
    array = array.astype(np.int64, copy=False)
    if array.size and int(array.min()) < 1:
        raise ValueError("lengths must be positive")
    return array[array <= capacity]


def lower_bound_l1(lengths: np.ndarray, capacity: int) -> int:
    """ceil(sum of the lengths that fit / capacity)."""
    capacity = _positive_int(capacity, "capacity")
    return -(-int(_fitting_lengths(lengths, capacity).sum()) // capacity)


def lower_bound_l2_from_counts(counts: np.ndarray, capacity: int) -> int:
    """Martello-Toth L2 from a histogram: counts[v] items of length v, v = 0..capacity.

    For each 0 <= k <= capacity/2: J1 = items > capacity - k, J2 = items in (capacity/2, capacity - k],
    J3 = items in [k, capacity/2]; L(k) = |J1| + |J2| + max(0, ceil((sum J3 - free space in J2) / capacity)).
    """
    capacity = _positive_int(capacity, "capacity")
    counts = np.asarray(counts, dtype=np.int64)
    if len(counts) != capacity + 1:
        raise ValueError(f"counts must have capacity + 1 = {capacity + 1} entries, got {len(counts)}")
    counts = counts.copy()
    counts[0] = 0
    sizes = np.arange(capacity + 1, dtype=np.int64)
    # at_least[v]: items (or tokens) of length >= v, for v = 0..capacity + 1
    count_at_least = np.append(np.cumsum(counts[::-1])[::-1], 0)
    tokens_at_least = np.append(np.cumsum((counts * sizes)[::-1])[::-1], 0)
    k = np.arange(capacity // 2 + 1, dtype=np.int64)
    above_half = capacity // 2 + 1
    j1 = count_at_least[capacity - k + 1]
    j2 = count_at_least[above_half] - j1
    j2_tokens = tokens_at_least[above_half] - tokens_at_least[capacity - k + 1]
    j3_tokens = tokens_at_least[np.maximum(k, 1)] - tokens_at_least[above_half]
    overflow = j3_tokens - (j2 * capacity - j2_tokens)
    bound = j1 + j2 + np.maximum(0, -(-overflow // capacity))
    return int(bound.max(initial=0))


def lower_bound_l2(lengths: np.ndarray, capacity: int) -> int:
    """Martello-Toth L2 lower bound on the number of bins for the lengths that fit."""
    capacity = _positive_int(capacity, "capacity")
    fits = _fitting_lengths(lengths, capacity)
    if capacity <= _HISTOGRAM_CAPACITY_LIMIT:
        return lower_bound_l2_from_counts(np.bincount(fits, minlength=capacity + 1), capacity)
    # Large capacity: only k = 0 and the item sizes <= capacity/2 can give the maximum.
    ordered = np.sort(fits)
    prefix = np.concatenate(([0], np.cumsum(ordered)))
    total = int(prefix[-1])

    def at_least(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        first = np.searchsorted(ordered, v, side="left")
        return len(ordered) - first, total - prefix[first]

    k = np.concatenate(([0], np.unique(ordered[2 * ordered <= capacity])))
    j1, j1_tokens = at_least(capacity - k + 1)
    half_count, half_tokens = at_least(np.array([capacity // 2 + 1]))
    j2 = half_count - j1
    j2_tokens = half_tokens - j1_tokens
    _, k_tokens = at_least(np.maximum(k, 1))
    overflow = (k_tokens - half_tokens) - (j2 * capacity - j2_tokens)
    bound = j1 + j2 + np.maximum(0, -(-overflow // capacity))
    return int(bound.max(initial=0))


def lower_bound_item_cap(lengths: np.ndarray, capacity: int, max_items: int) -> int:
    """Lower bound on bins when a bin holds at most `max_items` items.

    A full-length item fills its bin; an item longer than capacity/2 shares its bin with at most
    max_items - 1 items of at most capacity/2; the other short items need bins of max_items each.
    """
    capacity = _positive_int(capacity, "capacity")
    max_items = _positive_int(max_items, "max_items")
    fits = _fitting_lengths(lengths, capacity)
    full = int(np.count_nonzero(fits == capacity))
    big = int(np.count_nonzero((2 * fits > capacity) & (fits < capacity)))
    small = len(fits) - full - big
    return full + big + -(-max(0, small - (max_items - 1) * big) // max_items)


def lower_bound_images(
    lengths: np.ndarray,
    image_counts: np.ndarray,
    capacity: int,
    max_images: int,
    max_items: int | None = None,
) -> int:
    """Lower bound on bins holding at most `capacity` tokens and `max_images` images (and `max_items`).

    Counts only the items that fit (length <= capacity, images <= max_images). The maximum of the
    Martello-Toth L2 bound on tokens, the same bound on images (bins of `max_images`, so it includes
    ceil(images / max_images) and the rule that two items of more than max_images / 2 images never share
    a bin), with an item cap `lower_bound_item_cap`, and the long-item bound below (image room that
    bins of long samples cannot use).
    """
    capacity = _positive_int(capacity, "capacity")
    lengths = np.asarray(lengths)
    images = np.asarray(image_counts, dtype=np.int64)
    if images.shape != lengths.shape:
        raise ValueError(f"image_counts {images.shape} must match lengths {lengths.shape}")
    if isinstance(max_images, bool) or not isinstance(max_images, int | np.integer) or max_images < 0:
        raise ValueError(f"max_images must be an integer >= 0, got {max_images!r}")
    keep = images <= max_images
    fits = _fitting_lengths(lengths[keep], capacity)
    fit_images = images[keep][lengths[keep] <= capacity]
    bound = lower_bound_l2(fits, capacity)
    if max_images > 0 and fit_images.size:
        image_histogram = np.bincount(fit_images, minlength=max_images + 1)
        bound = max(bound, lower_bound_l2_from_counts(image_histogram, max_images))
    if max_items is not None:
        bound = max(bound, lower_bound_item_cap(fits, capacity, max_items))
    return max(bound, _long_item_image_bound(fits, fit_images, capacity, max_images))


def lower_bound_images_lp(
    lengths: np.ndarray,
    image_counts: np.ndarray,
    capacity: int,
    max_images: int,
    max_items: int | None = None,
    **options: Any,
) -> int:
    """LP (configuration model) lower bound on bins under a token capacity, an image cap and an item cap.

    Lengths are rounded down (`image_cap_lp`'s `length_units`: a relaxation, whatever fits before fits after)
    and the LP "fewest bins covering every (length, images) class" is solved by column generation
    (`image_cap_lp`, `options` go to it). Every round gives a valid bound, duals . demand / best pattern
    value (Farley), converged or not. Returns the larger of that and `lower_bound_images`. Needs scipy.
    """
    simple = lower_bound_images(lengths, image_counts, capacity, max_images, max_items)
    farley, _ = image_cap_lp(lengths, image_counts, capacity, max_images, max_items, **options)
    return max(simple, int(-(-farley * (1 - 1e-9) // 1)))


def image_cap_lp(
    lengths: np.ndarray,
    image_counts: np.ndarray,
    capacity: int,
    max_images: int,
    max_items: int | None = None,
    *,
    length_units: int = 256,
    max_rounds: int = 400,
    round_up: bool = False,
) -> tuple[float, float]:
    """Column generation for the configuration LP of image-capped packing: (best Farley bound, master value).

    Lengths are rounded to multiples of ceil(capacity / length_units): down (`round_up=False`: the LP is a
    relaxation, the Farley value a lower bound on bins) or up (every LP bin content fits the real items, so
    the master value, once converged, bounds from above what rounding that LP solution would need). The
    master LP is solved by scipy's HiGHS, the pricing knapsack exactly (`_bound_kernels`).
    """
    from scipy.optimize import linprog

    from mmpack.packing._bound_kernels import best_pattern_kernel

    capacity = _positive_int(capacity, "capacity")
    lengths = np.asarray(lengths, dtype=np.int64)
    images = np.asarray(image_counts, dtype=np.int64)
    keep = (lengths <= capacity) & (images <= max_images)
    if not keep.any():
        return 0.0, 0.0
    unit = -(-capacity // length_units)
    rounded = -(-lengths[keep] // unit) if round_up else lengths[keep] // unit
    classes, demand = np.unique(np.stack([rounded, images[keep]]), axis=1, return_counts=True)
    units, class_images = classes[0].astype(np.int64), classes[1].astype(np.int64)
    capacity_units, item_cap = capacity // unit, 0 if max_items is None else int(max_items)
    alone = np.minimum(capacity_units // np.maximum(units, 1), max_images // np.maximum(class_images, 1))
    alone = np.minimum(np.minimum(alone, demand), item_cap if item_cap else demand)
    columns = [np.where(np.arange(len(demand)) == c, max(int(alone[c]), 1), 0) for c in range(len(demand))]
    farley, master = 0.0, float("inf")
    for _ in range(max_rounds):
        matrix = np.stack(columns, axis=1).astype(np.float64)
        result = linprog(np.ones(len(columns)), A_ub=-matrix, b_ub=-demand.astype(np.float64), method="highs")
        if result.status != 0:
            raise RuntimeError(f"master LP failed: {result.message}")
        master = float(result.fun)
        duals = np.maximum(-result.ineqlin.marginals, 0.0)
        value, pattern = best_pattern_kernel(
            units, class_images, duals, demand.astype(np.int64), capacity_units, max_images, item_cap
        )
        farley = max(farley, float(duals @ demand) / max(value, 1e-12))
        if value <= 1.0 + 1e-9:
            break
        columns.append(pattern)
    return farley, master


def _long_item_image_bound(lengths: np.ndarray, images: np.ndarray, capacity: int, max_images: int) -> int:
    """Bins >= long items + the images no long item's bin can take, in bins of `max_images`.

    A bin holds at most one long item (length > capacity/2). The bin of long item x takes at most
    max_images - images(x) images of short items, and none when the shortest short item with images
    does not fit beside x (a full-length sample leaves its bin's image room unused).
    """
    if max_images == 0 or lengths.size == 0:
        return 0
    long = 2 * lengths > capacity
    short_with_images = lengths[~long & (images > 0)]
    if short_with_images.size == 0:
        return int(np.count_nonzero(long))
    shortest = int(short_with_images.min())
    room = np.where(capacity - lengths[long] >= shortest, max_images - images[long], 0)
    left = int(images[~long].sum()) - int(room.sum())
    return int(np.count_nonzero(long)) + -(-max(0, left) // max_images)


def lower_bound_caps(
    lengths: np.ndarray,
    capacity: int,
    *,
    max_items: int | None = None,
    image_counts: np.ndarray | None = None,
    max_images: int | None = None,
) -> int:
    """Lower bound on bins under per-bin caps, over the items that fit: the largest of L2 and the item-cap bound
    (`lower_bound_item_cap`); with an image cap, `lower_bound_images` (items over the image cap are rejects,
    as in `pack_lengths`, and not counted)."""
    if max_images is not None and image_counts is not None:
        return lower_bound_images(lengths, image_counts, capacity, max_images, max_items)
    capacity = _positive_int(capacity, "capacity")
    lengths = np.asarray(lengths)
    fits = lengths <= capacity
    bound = lower_bound_l2(lengths[fits], capacity)
    if max_items is not None:
        bound = max(bound, lower_bound_item_cap(lengths[fits], capacity, max_items))
    return int(bound)


def _summary(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"mean": 0.0, "p50": 0.0, "max": 0.0}
    return {"mean": float(values.mean()), "p50": float(np.median(values)), "max": float(values.max())}


def packing_stats(
    lengths: np.ndarray, bin_ids: np.ndarray, capacity: int, image_counts: np.ndarray | None = None
) -> dict:
    """Efficiency of a packing, as a JSON-serialisable dict of plain Python values.

    Keys: num_samples (samples in bins), num_rejected (bin id -1), num_bins (bins holding samples),
    capacity, total_tokens, padding_tokens, fill_efficiency, lower_bound_bins (L1),
    l2_lower_bound_bins, gap_to_l2 ((bins - L2) / L2), padding_compression (padding if every sample
    were padded to capacity / padding after packing; None when packing leaves no padding),
    samples_per_bin {mean, p50, max}, images_per_bin {mean, max}, fill_histogram {range: bins}.
    """
    capacity = _positive_int(capacity, "capacity")
    lengths = np.asarray(lengths)
    bin_ids = np.asarray(bin_ids)
    if lengths.ndim != 1 or bin_ids.shape != lengths.shape:
        raise ValueError(f"lengths {lengths.shape} and bin_ids {bin_ids.shape} must be 1-D of equal length")
    if lengths.size and not (
        np.issubdtype(lengths.dtype, np.integer) and np.issubdtype(bin_ids.dtype, np.integer)
    ):
        raise ValueError("lengths and bin_ids must be integer arrays")
    lengths = lengths.astype(np.int64, copy=False)
    bin_ids = bin_ids.astype(np.int64, copy=False)
    if bin_ids.size and int(bin_ids.min()) < -1:
        raise ValueError("bin ids must be >= -1")
    placed = bin_ids >= 0
    placed_bins = bin_ids[placed]
    placed_lengths = lengths[placed]
    tokens_per_bin = np.bincount(placed_bins, weights=placed_lengths).astype(np.int64)
    samples_per_bin = np.bincount(placed_bins, minlength=len(tokens_per_bin))
    used = samples_per_bin > 0
    tokens_per_bin, samples_per_bin = tokens_per_bin[used], samples_per_bin[used]
    if tokens_per_bin.size and int(tokens_per_bin.max()) > capacity:
        raise ValueError(f"a bin holds {int(tokens_per_bin.max())} tokens, more than capacity {capacity}")
    if image_counts is None:
        images_per_bin = np.zeros(len(tokens_per_bin), dtype=np.int64)
    else:
        images = np.asarray(image_counts, dtype=np.int64)
        if images.shape != lengths.shape:
            raise ValueError(f"image_counts {images.shape} must match lengths {lengths.shape}")
        images_per_bin = np.bincount(placed_bins, weights=images[placed], minlength=len(used))[used]
    num_bins = len(tokens_per_bin)
    total_tokens = int(placed_lengths.sum())
    padding = num_bins * capacity - total_tokens
    padding_unpacked = int(placed.sum()) * capacity - total_tokens
    fill = tokens_per_bin / capacity
    histogram = {
        name: int(np.count_nonzero((fill >= low) & (fill < high))) for name, low, high in FILL_BUCKETS
    }
    l2 = lower_bound_l2(placed_lengths, capacity)
    return {
        "num_samples": int(placed.sum()),
        "num_rejected": int(np.count_nonzero(bin_ids == -1)),
        "num_bins": num_bins,
        "capacity": capacity,
        "total_tokens": total_tokens,
        "padding_tokens": int(padding),
        "fill_efficiency": float(total_tokens / (num_bins * capacity)) if num_bins else 0.0,
        "lower_bound_bins": lower_bound_l1(placed_lengths, capacity),
        "l2_lower_bound_bins": l2,
        "gap_to_l2": float((num_bins - l2) / l2) if l2 else 0.0,
        "padding_compression": float(padding_unpacked / padding) if padding else None,
        "samples_per_bin": _summary(samples_per_bin),
        "images_per_bin": {k: v for k, v in _summary(images_per_bin).items() if k != "p50"},
        "fill_histogram": histogram,
    }
