"""`mmpack stats --compare`: pack the same lengths with every algorithm (and the caps given), side by side."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from mmpack.packing.binpack import ALGORITHMS, pack_lengths
from mmpack.packing.stats import lower_bound_caps, lower_bound_l2, packing_stats


def algorithm_names() -> list[str]:
    """The algorithms mmpack.packing.binpack offers, in its own order."""
    return [str(name) for name in ALGORITHMS]


def _warm_up(algorithm: str, caps: dict[str, Any], with_images: bool) -> None:
    # numba compiles on first call: pack a tiny input first so the timed run measures packing only
    lengths = np.array([3, 5, 2, 7], dtype=np.int64)
    images = np.ones(4, dtype=np.int64) if with_images else None
    pack_lengths(lengths, 8, algorithm=algorithm, image_counts=images, **caps)


def caps_bound_field(
    lengths: np.ndarray,
    capacity: int,
    images: np.ndarray | None,
    max_items: int | None,
    max_images: int | None,
) -> dict[str, int]:
    """{"caps_lower_bound_bins": bound} under per-bin caps (where L2 can be far below what is reachable), else {}."""
    if max_items is None and max_images is None:
        return {}
    bound = lower_bound_caps(
        lengths, capacity, max_items=max_items, image_counts=images, max_images=max_images
    )
    return {"caps_lower_bound_bins": bound}


def result_columns(num_bins: int, fill_efficiency: float, l2: int, time_s: float | None) -> dict[str, Any]:
    """The outcome columns of a compare row: bins, fill, L2 and the gap to it, time."""
    return {
        "num_bins": num_bins,
        "fill_efficiency": fill_efficiency,
        "l2_lower_bound_bins": l2,
        "gap_to_l2_bins": num_bins - l2,
        "gap_to_l2": (num_bins - l2) / l2 if l2 else 0.0,
        "time_s": time_s,
    }


def compare_algorithms(
    lengths: np.ndarray,
    capacity: int,
    *,
    image_counts: np.ndarray | None = None,
    cap_settings: list[tuple[int | None, int | None]] | None = None,
    algorithms: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Pack `lengths` with each algorithm under each (max_samples_per_bin, max_images_per_bin) setting.

    Returns one row per run: algorithm, caps, num_bins, fill_efficiency, gap_to_l2_bins, gap_to_l2 (relative),
    caps_lower_bound_bins (with caps only), time_s (JIT warm-up excluded), or `error` when the algorithm
    rejects the setting.
    """
    settings = cap_settings or [(None, None)]
    l2 = int(lower_bound_l2(lengths[lengths <= capacity], capacity))
    rows = []
    for max_items, max_images in settings:
        caps: dict[str, Any] = {"max_items_per_bin": max_items}
        if max_images is not None:
            caps["max_images_per_bin"] = max_images
        images = image_counts if max_images is not None else None
        caps_bound = caps_bound_field(lengths, capacity, images, max_items, max_images)
        for algorithm in algorithms or algorithm_names():
            row: dict[str, Any] = {
                "algorithm": algorithm,
                "max_samples_per_bin": max_items,
                "max_images_per_bin": max_images,
            }
            try:
                _warm_up(algorithm, caps, images is not None)
                start = time.perf_counter()
                result = pack_lengths(lengths, capacity, algorithm=algorithm, image_counts=images, **caps)
                elapsed = time.perf_counter() - start
            except (ValueError, NotImplementedError) as e:
                rows.append({**row, "error": str(e)})
                continue
            stats = packing_stats(lengths, result.bin_ids, capacity, image_counts=image_counts)
            fill = float(stats["fill_efficiency"])
            rows.append(
                {
                    **row,
                    "resolved_algorithm": str(result.algorithm),
                    **result_columns(int(result.num_bins), fill, l2, elapsed),
                    **caps_bound,
                }
            )
    return rows
