"""Numba kernel of the LP lower bound for image-capped packing: the pricing knapsack.

Private module: the wrapper is `mmpack.packing.stats.lower_bound_images_lp`; the pure-Python counterpart is
`tests/support/reference.py:best_pattern`.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def best_pattern_kernel(units, images, values, counts, capacity_units, max_images, max_items):
    """The most valuable bin content: max sum values[c] * a[c] subject to sum units[c] * a[c] <= capacity_units,
    sum images[c] * a[c] <= max_images, sum a[c] <= max_items (0: no item cap) and 0 <= a[c] <= counts[c].

    Bounded knapsack by binary splitting of each class's copies, exact dynamic program over (units, images,
    items). Classes with value <= 0 are never taken. Returns (value, a).
    """
    num_classes = len(units)
    items_dim = max_items + 1 if max_items > 0 else 1
    most = num_classes * 64  # binary splitting: at most 63 pieces per class
    piece_units = np.empty(most, dtype=np.int64)
    piece_images = np.empty(most, dtype=np.int64)
    piece_items = np.empty(most, dtype=np.int64)
    piece_class = np.empty(most, dtype=np.int64)
    piece_copies = np.empty(most, dtype=np.int64)
    piece_values = np.empty(most, dtype=np.float64)
    pieces = 0
    for c in range(num_classes):
        if values[c] <= 0:
            continue
        limit = counts[c]
        if units[c] > 0:
            limit = min(limit, capacity_units // units[c])
        if images[c] > 0:
            limit = min(limit, max_images // images[c])
        if max_items > 0:
            limit = min(limit, max_items)
        size = 1
        while limit > 0:
            take = min(size, limit)
            piece_units[pieces] = units[c] * take
            piece_images[pieces] = images[c] * take
            piece_items[pieces] = take if max_items > 0 else 0
            piece_values[pieces] = values[c] * take
            piece_class[pieces] = c
            piece_copies[pieces] = take
            pieces += 1
            limit -= take
            size *= 2
    best = np.zeros((capacity_units + 1, max_images + 1, items_dim))
    chosen = np.zeros((pieces, capacity_units + 1, max_images + 1, items_dim), dtype=np.bool_)
    for p in range(pieces):
        pu, pi, pk, pv = piece_units[p], piece_images[p], piece_items[p], piece_values[p]
        for u in range(capacity_units, pu - 1, -1):
            for m in range(max_images, pi - 1, -1):
                for k in range(items_dim - 1, pk - 1, -1):
                    candidate = best[u - pu, m - pi, k - pk] + pv
                    if candidate > best[u, m, k]:
                        best[u, m, k] = candidate
                        chosen[p, u, m, k] = True
    a = np.zeros(num_classes, dtype=np.int64)
    u, m, k = capacity_units, max_images, items_dim - 1
    for p in range(pieces - 1, -1, -1):
        if chosen[p, u, m, k]:
            a[piece_class[p]] += piece_copies[p]
            u -= piece_units[p]
            m -= piece_images[p]
            k -= piece_items[p]
    return best[capacity_units, max_images, items_dim - 1], a
