"""Numba kernels for bin packing over plain numpy arrays.

Private module: the validating wrappers live in `packing.binpack`. Every kernel here has a slow
pure-Python counterpart in `tests/reference.py`.

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
            next_in_class[b] = head[key]
            if head[key] == -1:
                _bitset_set(bits, offsets, key)
            head[key] = b
    return bin_ids, num_bins


@njit(cache=True)
def _push_bin(bits, offsets, head, next_in_class, key, b):
    if head[key] == -1:
        _bitset_set(bits, offsets, key)
    next_in_class[b] = head[key]
    head[key] = b


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


# ---------------------------------------------------------------------------------------------
# Greedy minimum-slack patterns over the length histogram
# ---------------------------------------------------------------------------------------------


@njit(cache=True)
def _best_fill(counts, gap, largest, max_fillers, min_items, used):
    """Fill `gap` from `counts` (lengths <= largest) with at most `max_fillers` items.

    Maximises the filled amount, then minimises the number of items, then prefers longer items
    (types are visited longest first and only a strict improvement replaces a solution).
    Returns the number of distinct lengths used; the chosen (length, count) pairs are written to
    `used` as used[k, 0] = length, used[k, 1] = count.
    """
    big = np.int64(1) << 40
    min_items[: gap + 1] = big
    min_items[0] = 0
    num_types = 0
    for size in range(min(gap, largest), 0, -1):
        if counts[size] > 0:
            num_types += 1
    choice = np.zeros((num_types, gap + 1), dtype=np.int32)
    sizes = np.empty(num_types, dtype=np.int64)
    t = 0
    for size in range(min(gap, largest), 0, -1):
        available = counts[size]
        if available == 0:
            continue
        sizes[t] = size
        if available * size >= gap:  # unbounded in effect: one ascending pass
            for v in range(size, gap + 1):
                candidate = min_items[v - size] + 1
                if candidate < min_items[v]:
                    min_items[v] = candidate
                    choice[t, v] = choice[t, v - size] + 1
        else:  # bounded: descending so that each v reads the values before this type
            for v in range(gap, size - 1, -1):
                best = min_items[v]
                best_j = 0
                for j in range(1, min(available, v // size) + 1):
                    candidate = min_items[v - j * size] + j
                    if candidate < best:
                        best = candidate
                        best_j = j
                if best_j > 0:
                    min_items[v] = best
                    choice[t, v] = best_j
        t += 1
    value = gap
    while value > 0 and (min_items[value] >= big or min_items[value] > max_fillers):
        value -= 1
    num_used = 0
    for t in range(num_types - 1, -1, -1):
        j = choice[t, value]
        if j > 0:
            used[num_used, 0] = sizes[t]
            used[num_used, 1] = j
            num_used += 1
            value -= j * sizes[t]
    return num_used


@njit(cache=True)
def pattern_greedy_kernel(counts, capacity, max_items, fewest_below=0, cheap=False):
    """Pack a histogram by repeated minimum-slack patterns.

    Take the longest remaining length s, fill the rest of its bin as fully as possible (fewest
    items on ties) from what remains, and emit that pattern as many times as the counts allow.
    Each emission exhausts at least one length's count, so there are few patterns.
    Anchors shorter than `fewest_below` take the fewest fillers, longer ones the most (only under
    an item cap of at most 16). `cheap` replaces the exact fill (a dynamic program over the gap)
    by the best one or two fillers plus the longest that still fit, for large capacities.
    Returns (starts, pattern_lengths, pattern_counts, multiplicity): pattern p is the pairs
    (pattern_lengths[e], pattern_counts[e]) for e in starts[p]:starts[p+1], used multiplicity[p] times.
    """
    remaining = counts.copy()
    min_items = np.empty(capacity + 1, dtype=np.int64)
    used = np.empty((capacity + 1, 2), dtype=np.int64)
    below = np.empty(capacity + 1, dtype=np.int64)
    starts = [0]
    pattern_lengths = [0]
    pattern_counts = [0]
    multiplicity = [0]
    pattern_lengths.pop()
    pattern_counts.pop()
    multiplicity.pop()
    longest = capacity
    while True:
        while longest > 0 and remaining[longest] == 0:
            longest -= 1
        if longest == 0:
            break
        gap = capacity - longest
        remaining[longest] -= 1
        if gap == 0 or max_items <= 1:
            num_used = 0
        elif cheap:
            num_used = _pair_fill(remaining, gap, longest, max_items - 1, below, used)
        elif max_items > 16 and remaining[gap] > 0:
            used[0, 0] = gap
            used[0, 1] = 1
            num_used = 1
        elif max_items <= 16 and longest >= fewest_below:
            num_used = _best_fill_capped(remaining, gap, longest, max_items - 1, used)
        else:
            num_used = _best_fill(remaining, gap, longest, max_items - 1, min_items, used)
        remaining[longest] += 1
        own = 1  # copies of `longest` in the pattern
        for k in range(num_used):
            if used[k, 0] == longest:
                own += used[k, 1]
        times = remaining[longest] // own
        for k in range(num_used):
            if used[k, 0] != longest:
                times = min(times, remaining[used[k, 0]] // used[k, 1])
        pattern_lengths.append(longest)
        pattern_counts.append(own)
        remaining[longest] -= times * own
        for k in range(num_used):
            if used[k, 0] != longest:
                pattern_lengths.append(used[k, 0])
                pattern_counts.append(used[k, 1])
                remaining[used[k, 0]] -= times * used[k, 1]
        starts.append(len(pattern_lengths))
        multiplicity.append(times)
    return (
        np.array(starts, dtype=np.int64),
        np.array(pattern_lengths, dtype=np.int64),
        np.array(pattern_counts, dtype=np.int64),
        np.array(multiplicity, dtype=np.int64),
    )


@njit(cache=True)
def pattern_slots_kernel(counts, starts, pattern_lengths, pattern_counts, multiplicity):
    """Slots (see `assign_slots_kernel`) for histogram patterns; bins numbered in pattern order."""
    cursor = bucket_starts_kernel(counts)
    slots = np.empty(counts.sum(), dtype=np.int64)
    b = 0
    for p in range(len(multiplicity)):
        for _ in range(multiplicity[p]):
            for e in range(starts[p], starts[p + 1]):
                size = pattern_lengths[e]
                take = pattern_counts[e]
                slots[cursor[size] : cursor[size] + take] = b
                cursor[size] += take
            b += 1
    return slots, b


@njit(cache=True)
def _best_fill_capped(counts, gap, largest, max_fillers, used):
    """Fill `gap` with at most `max_fillers` items: most filled, then most items, then longest item.

    Under an item cap the scarce resource is slots, and mid-size items are the ones left over at the
    end (two of them leave a gap that nothing fits), so among equally good fills the one whose
    longest item is longest is kept: types are visited shortest first and a later type overwrites.
    reach[k, v]: some k items fill exactly v; choice[t, k, v]: copies of type t in that fill.
    """
    top = min(gap, largest)
    num_types = 0
    for size in range(1, top + 1):
        if counts[size] > 0:
            num_types += 1
    reach = np.zeros((max_fillers + 1, gap + 1), dtype=np.bool_)
    reach[0, 0] = True
    choice = np.zeros((num_types, max_fillers + 1, gap + 1), dtype=np.int8)
    sizes = np.empty(num_types, dtype=np.int64)
    t = 0
    for size in range(1, top + 1):
        available = counts[size]
        if available == 0:
            continue
        sizes[t] = size
        for k in range(max_fillers, 0, -1):  # descending k and v: read states before this type
            for v in range(gap, size - 1, -1):
                for j in range(1, min(available, k, v // size) + 1):
                    if reach[k - j, v - j * size]:
                        reach[k, v] = True
                        choice[t, k, v] = j
                        break
        t += 1
    best_v = -1
    best_k = 0
    for v in range(gap, -1, -1):
        for k in range(max_fillers, -1, -1):
            if reach[k, v]:
                best_v = v
                best_k = k
                break
        if best_v >= 0:
            break
    num_used = 0
    value = best_v
    k = best_k
    for t in range(num_types - 1, -1, -1):
        j = choice[t, k, value]
        if j > 0:
            used[num_used, 0] = sizes[t]
            used[num_used, 1] = j
            num_used += 1
            value -= j * sizes[t]
            k -= j
    return num_used


@njit(cache=True)
def _pair_fill(counts, gap, largest, max_fillers, below, used):
    """Cheap fill for large capacities: the best one or two fillers, then the longest that still fit.

    `below[v]` is filled with the longest available length <= v (0: none). O(gap) per call.
    """
    top = min(gap, largest)
    last = 0
    for v in range(top + 1):
        if v > 0 and counts[v] > 0:
            last = v
        below[v] = last
    best_a = below[top]
    best_b = 0
    if max_fillers >= 2 and best_a < gap:
        for a in range(1, top // 2 + 1):
            if counts[a] == 0:
                continue
            b = below[min(gap - a, top)]
            if b == a and counts[a] < 2:
                b = below[a - 1]
            if b < a:
                continue
            if a + b > best_a + best_b:
                best_a, best_b = b, a
                if a + b == gap:
                    break
    num_used = 0
    if best_a > 0:
        used[0, 0] = best_a
        used[0, 1] = 1
        num_used = 1
    if best_b > 0:
        if best_b == best_a:
            used[0, 1] = 2
        else:
            used[1, 0] = best_b
            used[1, 1] = 1
            num_used = 2
    room = gap - best_a - best_b
    taken = (1 if best_a > 0 else 0) + (1 if best_b > 0 else 0)
    size = below[min(room, top)]
    while room > 0 and size > 0 and taken < max_fillers:
        already = 0
        for k in range(num_used):
            if used[k, 0] == size:
                already = used[k, 1]
        if counts[size] > already:
            if already > 0:
                for k in range(num_used):
                    if used[k, 0] == size:
                        used[k, 1] += 1
            else:
                used[num_used, 0] = size
                used[num_used, 1] = 1
                num_used += 1
            room -= size
            taken += 1
            size = below[min(room, top)]
        else:
            size = below[size - 1]
    return num_used
