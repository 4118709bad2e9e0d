"""Numba kernels for bin packing over plain numpy arrays (item level and length histogram).

Private module: the validating wrappers live in `mmpack.packing.binpack`. Every kernel here has a slow
pure-Python counterpart in `tests/support/reference.py`.

Conventions shared by all kernels: `lengths` is int64, `capacity` is a positive int; items that can
never be placed (longer than the capacity, or with more images than a bin may hold) get bin -1;
bins are numbered in the order they are opened.
"""

from __future__ import annotations

import numpy as np
from numba import njit

CHEAP_GAP = 512
# Lowest set bit of a word: multiply the isolated bit by a de Bruijn constant, look up the top 6 bits.
_DEBRUIJN_CONSTANT = 0x03F79D71B4CB0A89
_DEBRUIJN = np.uint64(_DEBRUIJN_CONSTANT)
_DEBRUIJN_TABLE = np.zeros(64, dtype=np.int64)
for _bit in range(64):
    _DEBRUIJN_TABLE[(((1 << _bit) * _DEBRUIJN_CONSTANT) & 0xFFFFFFFFFFFFFFFF) >> 58] = _bit


# ---------------------------------------------------------------------------------------------
# Hierarchical 64-ary bitset: "smallest set key >= x" in a few word operations.
# Layout: one flat uint64 array, level 0 (the keys) first; offsets[k] is where level k starts.
# ---------------------------------------------------------------------------------------------


@njit(cache=True)
def _lowest_bit(word):
    """Index of the lowest set bit of a non-zero uint64 word."""
    isolated = word & (~word + np.uint64(1))
    return _DEBRUIJN_TABLE[(isolated * _DEBRUIJN) >> np.uint64(58)]


@njit(cache=True)
def _bitset_new(num_keys):
    sizes = []
    size = max(num_keys, 1)
    while True:
        words = (size + 63) >> 6
        sizes.append(words)
        if words == 1:
            break
        size = words
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    for k in range(len(sizes)):
        offsets[k + 1] = offsets[k] + sizes[k]
    return np.zeros(offsets[-1], dtype=np.uint64), offsets


@njit(cache=True)
def _bitset_set(bits, offsets, key):
    for k in range(len(offsets) - 1):
        word = offsets[k] + (key >> 6)
        was_empty = bits[word] == 0
        bits[word] |= np.uint64(1) << np.uint64(key & 63)
        if not was_empty:
            return
        key >>= 6


@njit(cache=True)
def _bitset_clear(bits, offsets, key):
    for k in range(len(offsets) - 1):
        word = offsets[k] + (key >> 6)
        bits[word] &= ~(np.uint64(1) << np.uint64(key & 63))
        if bits[word] != 0:
            return
        key >>= 6


@njit(cache=True)
def _bitset_next(bits, offsets, key):
    """Smallest set key >= `key`, or -1."""
    levels = len(offsets) - 1
    level = 0
    while level < levels:
        word_index = key >> 6
        if word_index >= offsets[level + 1] - offsets[level]:
            return -1
        word = bits[offsets[level] + word_index] & (np.uint64(0xFFFFFFFFFFFFFFFF) << np.uint64(key & 63))
        if word != 0:
            key = (word_index << 6) + _lowest_bit(word)
            while level > 0:  # descend along the lowest set bits
                level -= 1
                key = (key << 6) + _lowest_bit(bits[offsets[level] + key])
            return key
        key = word_index + 1
        level += 1
    return -1


# ---------------------------------------------------------------------------------------------
# Sorting and histograms
# ---------------------------------------------------------------------------------------------


@njit(cache=True)
def histogram_kernel(lengths, capacity):
    """Counts per length 0..capacity; items longer than the capacity are not counted."""
    counts = np.zeros(capacity + 1, dtype=np.int64)
    for value in lengths:
        if value <= capacity:
            counts[value] += 1
    return counts


@njit(cache=True)
def bucket_starts_kernel(counts):
    """Where each length's run begins in the descending order: the number of longer items."""
    starts = np.zeros(len(counts), dtype=np.int64)
    for value in range(len(counts) - 2, -1, -1):
        starts[value] = starts[value + 1] + counts[value + 1]
    return starts


@njit(cache=True)
def order_desc_kernel(lengths, capacity):
    """Indices of the items that fit, by length descending, ties by index ascending (counting sort)."""
    counts = histogram_kernel(lengths, capacity)
    position = bucket_starts_kernel(counts)
    order = np.empty(counts.sum(), dtype=np.int64)
    for index in range(len(lengths)):
        value = lengths[index]
        if value <= capacity:
            order[position[value]] = index
            position[value] += 1
    return order


# ---------------------------------------------------------------------------------------------
# Next fit (input order) and first-fit decreasing
# ---------------------------------------------------------------------------------------------


@njit(cache=True)
def next_fit_kernel(lengths, capacity, max_items, image_counts, max_images):
    bin_ids = np.full(len(lengths), -1, dtype=np.int64)
    num_bins = 0
    remaining = -1
    items = 0
    images = 0
    for index in range(len(lengths)):
        size = lengths[index]
        need = image_counts[index]
        if size > capacity or need > max_images:
            continue
        if num_bins == 0 or size > remaining or items >= max_items or images + need > max_images:
            num_bins += 1
            remaining = capacity
            items = 0
            images = 0
        bin_ids[index] = num_bins - 1
        remaining -= size
        items += 1
        images += need
    return bin_ids, num_bins


@njit(cache=True)
def _ffd_update(tree_space, tree_room, leaf, space, room):
    node = leaf
    tree_space[node] = space
    tree_room[node] = room
    node >>= 1
    while node >= 1:
        tree_space[node] = max(tree_space[2 * node], tree_space[2 * node + 1])
        tree_room[node] = max(tree_room[2 * node], tree_room[2 * node + 1])
        node >>= 1


@njit(cache=True)
def _ffd_find(tree_space, tree_room, leaves, size, need, stack):
    """Leftmost leaf with space >= size and image room >= need (pruned depth-first search)."""
    stack[0] = 1
    top = 1
    while top > 0:
        top -= 1
        node = stack[top]
        if tree_space[node] < size or tree_room[node] < need:
            continue
        if node >= leaves:
            return node - leaves
        stack[top] = 2 * node + 1  # right after left
        stack[top + 1] = 2 * node
        top += 2
    return -1


@njit(cache=True)
def first_fit_decreasing_kernel(lengths, order, capacity, max_items, image_counts, max_images):
    """First fit over items in `order`; a max-tree over bins gives the leftmost bin that fits."""
    bin_ids = np.full(len(lengths), -1, dtype=np.int64)
    leaves = 1
    while leaves < max(len(order), 1):
        leaves *= 2
    # Unopened bins look empty, so the leftmost fitting bin is either open or the next new one.
    tree_space = np.full(2 * leaves, capacity, dtype=np.int64)
    tree_room = np.full(2 * leaves, max_images, dtype=np.int64)
    items = np.zeros(leaves, dtype=np.int64)
    stack = np.empty(130, dtype=np.int64)  # two entries per tree level at most
    num_bins = 0
    for index in order:
        size = lengths[index]
        need = image_counts[index]
        if need > max_images:
            continue
        b = _ffd_find(tree_space, tree_room, leaves, size, need, stack)
        num_bins = max(num_bins, b + 1)
        bin_ids[index] = b
        items[b] += 1
        space = tree_space[leaves + b] - size
        room = tree_room[leaves + b] - need
        if items[b] >= max_items:
            space = -1  # closed: the item cap is reached
            room = -1
        _ffd_update(tree_space, tree_room, leaves + b, space, room)
    return bin_ids, num_bins


# ---------------------------------------------------------------------------------------------
# Best-fit decreasing
# ---------------------------------------------------------------------------------------------


@njit(cache=True)
def _push_bin(bits, offsets, head, next_in_class, key, b):
    """Put bin `b` on top of the stack of class `key`, marking the class non-empty."""
    if head[key] == -1:
        _bitset_set(bits, offsets, key)
    next_in_class[b] = head[key]
    head[key] = b


@njit(cache=True)
def best_fit_decreasing_kernel(lengths, order, capacity, max_items, image_counts, max_images, room_classes):
    """Best fit over items in `order`, with per-bin caps on items and images.

    Open bins are grouped by key = room * (capacity + 1) + remaining space, where room is the image
    room clamped to `room_classes - 1` (bins with at least the largest image count of room are
    interchangeable). Each key holds a stack of bins; a bitset over keys finds the tightest class.
    The chosen bin has the least remaining space, then the least room, then was updated last.
    """
    stride = capacity + 1
    num_keys = room_classes * stride
    bits, offsets = _bitset_new(num_keys)
    head = np.full(num_keys, -1, dtype=np.int64)
    n = len(lengths)
    next_in_class = np.empty(n, dtype=np.int64)
    space = np.empty(n, dtype=np.int64)
    items = np.empty(n, dtype=np.int64)
    images = np.empty(n, dtype=np.int64)
    bin_ids = np.full(n, -1, dtype=np.int64)
    num_bins = 0
    for index in order:
        size = lengths[index]
        need = image_counts[index]
        if need > max_images:
            continue
        best_key = -1
        best_space = capacity + 1
        for room in range(need, room_classes):
            key = _bitset_next(bits, offsets, room * stride + size)
            if key >= 0 and key < (room + 1) * stride and key - room * stride < best_space:
                best_space = key - room * stride
                best_key = key
        if best_key >= 0:
            b = head[best_key]
            head[best_key] = next_in_class[b]
            if head[best_key] == -1:
                _bitset_clear(bits, offsets, best_key)
        else:
            b = num_bins
            num_bins += 1
            space[b] = capacity
            items[b] = 0
            images[b] = 0
        bin_ids[index] = b
        space[b] -= size
        items[b] += 1
        images[b] += need
        if space[b] > 0 and items[b] < max_items:
            key = min(max_images - images[b], room_classes - 1) * stride + space[b]
            _push_bin(bits, offsets, head, next_in_class, key, b)
    return bin_ids, num_bins


@njit(cache=True)
def best_fit_decreasing_histogram_kernel(counts, capacity, max_items):
    """Best fit decreasing over the length histogram, with an optional item cap (0: none).

    Open bins are grouped by (remaining space, items) (items only under a cap). Bins of one group are
    interchangeable, so for length s each bin of the tightest group takes as many items as fit in
    turn, exactly as item-by-item best fit would (ties: fewer items, then the bin updated last); the
    work is one step per (bin, distinct length) pair instead of one search per item.
    Returns (slots, num_bins): see `assign_slots_kernel`.
    """
    groups = max_items if max_items > 0 else 1
    bits, offsets = _bitset_new((capacity + 1) * groups)
    head = np.full((capacity + 1) * groups, -1, dtype=np.int64)
    total = counts.sum()
    next_in_class = np.empty(max(total, 1), dtype=np.int64)
    slots = np.empty(total, dtype=np.int64)
    cursor = bucket_starts_kernel(counts)
    num_bins = 0
    for size in range(capacity, 0, -1):
        left = counts[size]
        key = _bitset_next(bits, offsets, size * groups) if left > 0 else -1
        while left > 0 and key >= 0:
            space, items = key // groups, key % groups
            per_bin = space // size if max_items == 0 else min(space // size, max_items - items)
            while left > 0 and head[key] != -1:
                b = head[key]
                head[key] = next_in_class[b]
                take = min(per_bin, left)
                slots[cursor[size] : cursor[size] + take] = b
                cursor[size] += take
                left -= take
                if space - take * size > 0 and (max_items == 0 or items + take < max_items):
                    new_key = (space - take * size) * groups + (0 if max_items == 0 else items + take)
                    _push_bin(bits, offsets, head, next_in_class, new_key, b)
            if head[key] == -1:
                _bitset_clear(bits, offsets, key)
            key = _bitset_next(bits, offsets, key + 1)
        per_bin = capacity // size if max_items == 0 else min(capacity // size, max_items)
        while left > 0:
            b = num_bins
            num_bins += 1
            take = min(per_bin, left)
            slots[cursor[size] : cursor[size] + take] = b
            cursor[size] += take
            left -= take
            if capacity - take * size > 0 and (max_items == 0 or take < max_items):
                new_key = (capacity - take * size) * groups + (0 if max_items == 0 else take)
                _push_bin(bits, offsets, head, next_in_class, new_key, b)
    return slots, num_bins


@njit(cache=True)
def assign_slots_kernel(lengths, capacity, counts, slots):
    """Per-item bin ids from slots.

    `slots` lists bin ids grouped by length, longest length first (the same layout as the
    descending item order); the k-th item of length s in index order gets the k-th slot of s.
    """
    cursor = bucket_starts_kernel(counts)
    bin_ids = np.full(len(lengths), -1, dtype=np.int64)
    for index in range(len(lengths)):
        size = lengths[index]
        if size <= capacity:
            bin_ids[index] = slots[cursor[size]]
            cursor[size] += 1
    return bin_ids
