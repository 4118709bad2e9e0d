"""Numba kernels for histogram pattern packing (private; see `mmpack.packing.binpack`).

A pattern is a multiset of lengths that fits one bin; the greedy emits each pattern as many times as
the remaining counts allow, so the work depends on the number of distinct lengths, not of items.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from mmpack.packing._binpack_kernels import bucket_starts_kernel


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


@njit(cache=True)
def pattern_greedy_kernel(counts, capacity, max_items, fewest_below=0, cheap=False, work_budget=1 << 62):
    """Pack a histogram by repeated minimum-slack patterns.

    Take the longest remaining length s, fill the rest of its bin as fully as possible (fewest
    items on ties) from what remains, and emit that pattern as many times as the counts allow.
    Each emission exhausts at least one length's count, so there are few patterns.
    Anchors shorter than `fewest_below` take the fewest fillers, longer ones the most (only under
    an item cap of at most 16). `cheap` replaces the exact fill (a dynamic program over the gap)
    by the best one or two fillers plus the longest that still fit, for large capacities; so does
    running out of `work_budget` (about the number of dynamic-program steps), which bounds the time.
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
    work = 0
    while True:
        while longest > 0 and remaining[longest] == 0:
            longest -= 1
        if longest == 0:
            break
        gap = capacity - longest
        remaining[longest] -= 1
        if gap == 0 or max_items <= 1:
            num_used = 0
        elif cheap or work > work_budget:
            num_used = _pair_fill(remaining, gap, longest, max_items - 1, below, used)
        elif max_items > 16 and remaining[gap] > 0:
            used[0, 0] = gap
            used[0, 1] = 1
            num_used = 1
        elif max_items <= 16 and longest >= fewest_below:
            num_used = _best_fill_capped(remaining, gap, longest, max_items - 1, used)
            work += gap * min(gap, longest) * (max_items - 1)
        else:
            num_used = _best_fill(remaining, gap, longest, max_items - 1, min_items, used)
            work += gap * min(gap, longest)
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
