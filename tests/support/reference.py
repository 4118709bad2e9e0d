"""Slow, obviously-correct pure-Python references for the bin-packing kernels and lower bounds.

Each function mirrors one kernel in `mmpack.packing._binpack_kernels` (or a bound in `mmpack.packing.stats`),
including its tie-breaking, so tests can compare outputs exactly.
"""

from __future__ import annotations

import itertools
import math

UNLIMITED = 1 << 62


def _fits_any_bin(size: int, need: int, capacity: int, max_images: int) -> bool:
    return size <= capacity and need <= max_images


def descending_order(lengths: list[int], capacity: int) -> list[int]:
    """Items that fit, longest first, ties by index."""
    return sorted((i for i, s in enumerate(lengths) if s <= capacity), key=lambda i: (-lengths[i], i))


def next_fit(lengths, capacity, max_items=UNLIMITED, images=None, max_images=UNLIMITED):
    images = images or [0] * len(lengths)
    bin_ids = [-1] * len(lengths)
    bins: list[list[int]] = []  # per bin: [tokens, items, images]
    for i, (size, need) in enumerate(zip(lengths, images)):
        if not _fits_any_bin(size, need, capacity, max_images):
            continue
        last = bins[-1] if bins else None
        if last is None or last[0] + size > capacity or last[1] >= max_items or last[2] + need > max_images:
            bins.append([0, 0, 0])
            last = bins[-1]
        last[0] += size
        last[1] += 1
        last[2] += need
        bin_ids[i] = len(bins) - 1
    return bin_ids, len(bins)


def first_fit_decreasing(lengths, capacity, max_items=UNLIMITED, images=None, max_images=UNLIMITED):
    images = images or [0] * len(lengths)
    bin_ids = [-1] * len(lengths)
    bins: list[list[int]] = []
    for i in descending_order(lengths, capacity):
        size, need = lengths[i], images[i]
        if need > max_images:
            continue
        fitting = [
            b
            for b, (tokens, items, imgs) in enumerate(bins)
            if tokens + size <= capacity and items < max_items and imgs + need <= max_images
        ]
        if not fitting:
            bins.append([0, 0, 0])
        b = fitting[0] if fitting else len(bins) - 1
        bins[b][0] += size
        bins[b][1] += 1
        bins[b][2] += need
        bin_ids[i] = b
    return bin_ids, len(bins)


def best_fit_decreasing(
    lengths, capacity, max_items=UNLIMITED, images=None, max_images=UNLIMITED, order=None
):
    """Best fit: least space left, then (with an image cap) least image room clamped to the largest
    image count or (without) fewest items, then the bin updated most recently. Items go in `order`
    (default: longest first)."""
    image_capped = images is not None and max_images < UNLIMITED and any(images)
    images = images or [0] * len(lengths)
    top_room = min(max(images, default=0), max_images) if image_capped else 0
    bin_ids = [-1] * len(lengths)
    bins: list[dict] = []
    for step, i in enumerate(descending_order(lengths, capacity) if order is None else order):
        size, need = lengths[i], images[i]
        if need > max_images:
            continue
        best = None
        for b, state in enumerate(bins):
            space = capacity - state["tokens"]
            room = min(max_images - state["images"], top_room) if image_capped else 0
            if space >= size and state["items"] < max_items and room >= need:
                key = (space, room if image_capped else state["items"], -state["updated"])
                if best is None or key < best[0]:
                    best = (key, b)
        if best is None:
            bins.append({"tokens": 0, "items": 0, "images": 0, "updated": -1})
            b = len(bins) - 1
        else:
            b = best[1]
        bins[b]["tokens"] += size
        bins[b]["items"] += 1
        bins[b]["images"] += need
        bins[b]["updated"] = step
        bin_ids[i] = b
    return bin_ids, len(bins)


def bin_loads(lengths, bin_ids) -> list[int]:
    """Sorted tokens per bin."""
    loads: dict[int, int] = {}
    for size, b in zip(lengths, bin_ids):
        if b >= 0:
            loads[b] = loads.get(b, 0) + size
    return sorted(loads.values())


def lower_bound_l1(lengths, capacity) -> int:
    return math.ceil(sum(s for s in lengths if s <= capacity) / capacity)


def lower_bound_l2(lengths, capacity) -> int:
    """Martello-Toth L2, straight from the definition, for every k in 0..capacity/2."""
    items = [s for s in lengths if s <= capacity]
    best = 0
    for k in range(capacity // 2 + 1):
        j1 = [s for s in items if s > capacity - k]
        j2 = [s for s in items if capacity - k >= s and 2 * s > capacity]
        j3 = [s for s in items if 2 * s <= capacity and s >= k]
        spare = len(j2) * capacity - sum(j2)
        best = max(best, len(j1) + len(j2) + max(0, math.ceil((sum(j3) - spare) / capacity)))
    return best


def best_fill(counts: dict[int, int], gap: int, max_fillers: int) -> tuple[int, int, int]:
    """Fullest fill of `gap` from `counts` (length -> available) with at most `max_fillers` items.

    Returns (fill, fewest items reaching it, most items reaching it), by enumerating every multiset.
    """
    sizes = sorted(s for s, c in counts.items() if c > 0 and s <= gap)
    reachable: dict[int, set[int]] = {}

    def walk(index: int, total: int, items: int) -> None:
        reachable.setdefault(total, set()).add(items)
        if index == len(sizes):
            return
        size = sizes[index]
        for copies in range(min(counts[size], max_fillers - items, (gap - total) // size) + 1):
            walk(index + 1, total + copies * size, items + copies)

    walk(0, 0, 0)
    fill = max(reachable)
    return fill, min(reachable[fill]), max(reachable[fill])


def lower_bound_item_cap(lengths, capacity, max_items) -> int:
    """Full items alone; each long item (> capacity/2) takes at most max_items - 1 short ones."""
    items = [s for s in lengths if s <= capacity]
    full = sum(1 for s in items if s == capacity)
    big = sum(1 for s in items if capacity < 2 * s < 2 * capacity)
    small = len(items) - full - big
    return full + big + math.ceil(max(0, small - (max_items - 1) * big) / max_items)


# --------------------------------------------------------------------------------------------------
# Video frames and size: qwen-vl-utils 0.0.14 (`smart_nframes`, the frame indices and `smart_resize` of
# `fetch_video`) written out step by step, with torch's own linspace for the indices.


def qwen_vl_video_plan(
    total_frames: int,
    video_fps: float,
    height: int,
    width: int,
    *,
    fps: float = 2.0,
    min_frames: int = 4,
    max_frames: int = 768,
    min_pixels: int = 128 * 28 * 28,
    max_pixels: int = 768 * 28 * 28,
    model_seq_len: int = 128000,
) -> dict | None:
    """What qwen-vl-utils trains a video with (patch 14, merge 2, frame factor 2); None where it fails."""
    import torch

    factor = 28
    lowest = math.ceil(min_frames / 2) * 2
    highest = math.floor(min(max_frames, total_frames) / 2) * 2
    n = total_frames / video_fps * fps
    n = max(n, lowest)
    n = min(n, highest)
    n = min(n, total_frames)
    n = math.floor(n / 2) * 2
    if n < 2 or n > total_frames:
        return None
    indices = torch.linspace(0, total_frames - 1, n).round().long().tolist()

    total_pixels = model_seq_len * factor * factor * 0.9
    frame_max = max(min(max_pixels, total_pixels / n * 2), int(min_pixels * 1.05))
    if max(height, width) / min(height, width) > 200:
        return None
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > frame_max:
        beta = math.sqrt(height * width / frame_max)
        h = math.floor(height / beta / factor) * factor
        w = math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    if h == 0 or w == 0:
        return None
    sample_fps = n / total_frames * video_fps
    return {
        "indices": indices,
        "size": (h, w),
        "grid": (n // 2, h // 14, w // 14),
        "tokens": (n // 2) * (h // 28) * (w // 28),
        "second_per_grid_t": 2 / sample_fps,
    }


def image_fit(lengths, capacity, max_items, images, max_images):
    """Best fit over items sorted by length/capacity + w * images/max_images for w = 1, 2 (descending,
    ties by index), and over items sorted by images, then length; the fewest bins (the first on ties)."""
    fits = [i for i in range(len(lengths)) if lengths[i] <= capacity and images[i] <= max_images]
    cap = max(max_images, 1)
    orders = [sorted(fits, key=lambda i: (-(lengths[i] * cap + w * images[i] * capacity), i)) for w in (1, 2)]
    orders.append(sorted(fits, key=lambda i: (-images[i], -lengths[i], i)))
    best = None
    for order in orders:
        result = best_fit_decreasing(lengths, capacity, max_items, images, max_images, order)
        if best is None or result[1] < best[1]:
            best = result
    return best


def optimal_bins(lengths, capacity, images=None, max_images=UNLIMITED, max_items=UNLIMITED) -> int:
    """Fewest bins for the items that fit, by trying every assignment (tiny inputs only)."""
    images = images or [0] * len(lengths)
    items = [(s, m) for s, m in zip(lengths, images) if s <= capacity and m <= max_images]
    items.sort(reverse=True)
    best = len(items)
    loads: list[list[int]] = []  # per bin: [tokens, images, items]

    def place(k: int) -> None:
        nonlocal best
        if len(loads) >= best:
            return
        if k == len(items):
            best = len(loads)
            return
        size, need = items[k]
        for load in loads:
            if load[0] + size <= capacity and load[1] + need <= max_images and load[2] < max_items:
                load[0] += size
                load[1] += need
                load[2] += 1
                place(k + 1)
                load[0] -= size
                load[1] -= need
                load[2] -= 1
        loads.append([size, need, 1])
        place(k + 1)
        loads.pop()

    place(0)
    return best


def best_pattern(units, images, values, counts, capacity_units, max_images, max_items=0) -> float:
    """Value of the best bin content (see `_bound_kernels.best_pattern_kernel`), by enumeration."""
    best = 0.0

    def walk(c: int, used: int, imgs: int, items: int, value: float) -> None:
        nonlocal best
        best = max(best, value)
        if c == len(units):
            return
        for copies in range(counts[c] + 1):
            u, m, k = used + copies * units[c], imgs + copies * images[c], items + copies
            if u > capacity_units or m > max_images or (max_items and k > max_items):
                break
            walk(c + 1, u, m, k, value + copies * max(values[c], 0.0) if values[c] > 0 else value)

    walk(0, 0, 0, 0, 0.0)
    return best


def cp_split(cu_seqlens: list[int], cp_size: int, cp_rank: int) -> list[int]:
    """The flat-token index (-1 for a pad) of each token CP rank ``cp_rank`` holds: every segment padded to
    a multiple of 2 * CP, cut into 2 * CP chunks, chunks r and 2 * CP - 1 - r of each segment in order."""
    out: list[int] = []
    for start, end in itertools.pairwise(cu_seqlens):
        length = end - start
        padded = math.ceil(length / (2 * cp_size)) * 2 * cp_size
        tokens = [start + i if i < length else -1 for i in range(padded)]
        size = padded // (2 * cp_size)
        chunks = [tokens[i * size : (i + 1) * size] for i in range(2 * cp_size)]
        out += chunks[cp_rank] + chunks[2 * cp_size - 1 - cp_rank]
    return out
