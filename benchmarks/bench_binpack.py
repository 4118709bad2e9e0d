"""Bin-packing benchmark: mmpack's algorithms side by side with LightBinPack and `binpacking`.

    python benchmarks/bench_binpack.py                 # full run: 1M and 10M lognormal + histograms
    python benchmarks/bench_binpack.py --quick         # 100k lognormal, histograms scaled to 1M items

Section 1 packs lognormal(6.5, 0.9) lengths clipped to [1, 4096] into bins of 4096 tokens.
Section 3 (image caps) packs the same lognormal lengths with Poisson(0.7) images per sample, and with
image counts resampled from the held-in real data (../shared/data/mllm_demo, when present), under caps of
2, 4 and 8 images per bin (and cap 4 with at most 6 samples per bin), against the two-dimensional lower
bound `mmpack.packing.stats.lower_bound_images`.
Section 2 packs length histograms with many items and few distinct lengths (capacity 512), including
the Wikipedia (BERT pretraining, max length 512) histogram published by Krell et al. 2021,
"Efficient Sequence Packing without Cross-contamination" (arXiv:2107.02027).

Times are medians over --repeats runs after one warm-up run (the warm-up time, which includes
numba JIT compilation or loading it from the cache, is reported on its own): wall clock, and the
process CPU time, which a shared, loaded machine disturbs less (all kernels here are single-threaded). Peers get their input
as a ready Python list (conversion not timed). The `binpacking` package is pure Python and slow, so it
runs on a subsample (--binpacking-n), next to mmpack on the same subsample.
Results go to benchmarks/results/bench_binpack.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numba
import numpy as np

from mmpack.packing.binpack import PackResult, pack_lengths
from mmpack.packing.stats import lower_bound_images, lower_bound_item_cap, lower_bound_l2

RESULTS = Path(__file__).resolve().parent / "results" / "bench_binpack.json"
REAL_RECORDS = (
    Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mllm_demo" / "data" / "mllm_demo.json"
)

# Wikipedia sequence-length histogram for max length 512 (counts for lengths 1..512), as published
# with Krell et al. 2021 (arXiv:2107.02027). 16,279,552 sequences, 23% of them at full length.
WIKIPEDIA_512 = [
    0, 0, 0, 0, 1821, 1226, 1969, 1315, 1794, 1953, 3082, 3446, 4166, 5062, 9554, 16475, 19173, 17589, 17957,
    19060, 21555, 23524, 26954, 30661, 33470, 36614, 40134, 43256, 46094, 49350, 52153, 55428, 58109, 60624,
    63263, 64527, 65421, 66983, 68123, 68830, 70230, 70486, 72467, 72954, 73955, 74311, 74836, 74489, 74990,
    75377, 74954, 75096, 74784, 74698, 74337, 74638, 74370, 73537, 73597, 73153, 72358, 71580, 71082, 70085,
    69733, 69445, 67818, 67177, 66641, 65709, 64698, 63841, 63218, 62799, 61458, 60848, 60148, 59858, 58809,
    58023, 56920, 55999, 55245, 55051, 53979, 53689, 52819, 52162, 51752, 51172, 50469, 49907, 49201, 49060,
    47948, 47724, 46990, 46544, 46011, 45269, 44792, 44332, 43878, 43984, 42968, 42365, 42391, 42219, 41668,
    41072, 40616, 40587, 39999, 40169, 39340, 38906, 38438, 38142, 37757, 37818, 37535, 37217, 36757, 36589,
    36151, 35953, 35531, 35496, 35089, 35053, 34567, 34789, 34009, 33952, 33753, 33656, 33227, 32954, 32686,
    32880, 32709, 31886, 32126, 31657, 31466, 31142, 31106, 30650, 30316, 30494, 30328, 30157, 29611, 29754,
    29445, 28921, 29271, 29078, 28934, 28764, 28445, 28319, 28141, 28282, 27779, 27522, 27333, 27470, 27289,
    27102, 27018, 27066, 26925, 26384, 26188, 26385, 26392, 26082, 26062, 25660, 25682, 25547, 25425, 25072,
    25079, 25346, 24659, 24702, 24862, 24479, 24288, 24127, 24268, 24097, 23798, 23878, 23893, 23817, 23398,
    23382, 23280, 22993, 23018, 23242, 22987, 22894, 22470, 22612, 22452, 21996, 21843, 22094, 21916, 21756,
    21955, 21444, 21436, 21484, 21528, 21597, 21301, 21197, 21281, 21066, 20933, 21023, 20888, 20575, 20574,
    20511, 20419, 20312, 20174, 20023, 20087, 19955, 19946, 19846, 19562, 19710, 19556, 19477, 19487, 19387,
    19225, 19069, 19360, 18655, 19034, 18763, 18800, 19012, 18893, 18714, 18645, 18577, 18317, 18458, 18374,
    18152, 17822, 18102, 17735, 17940, 17805, 17711, 17690, 17703, 17669, 17410, 17583, 17331, 17313, 16892,
    16967, 16870, 16926, 17233, 16845, 16861, 16576, 16685, 16455, 16687, 16747, 16524, 16473, 16349, 16273,
    16255, 16228, 16219, 16021, 16111, 15867, 15751, 16081, 15703, 15751, 15854, 15665, 15469, 15431, 15428,
    15464, 15517, 15335, 15461, 15237, 15292, 15305, 15351, 15078, 14810, 15119, 14780, 14664, 14869, 14722,
    14890, 14672, 14439, 14685, 14706, 14840, 14373, 14286, 14596, 14615, 14168, 14299, 13987, 14167, 14107,
    14096, 14202, 13985, 14118, 14094, 14127, 13896, 13864, 13597, 13572, 13717, 13669, 13782, 13617, 13284,
    13333, 13425, 13457, 13256, 13404, 13318, 13425, 13317, 13179, 13193, 13257, 13160, 12813, 13149, 13010,
    12867, 12958, 12818, 12801, 12749, 12810, 12575, 12673, 12514, 12735, 12523, 12677, 12298, 12469, 12341,
    12445, 12477, 12326, 12110, 12087, 12305, 12156, 12032, 12190, 12150, 11980, 12022, 11825, 11969, 11831,
    11997, 11924, 11739, 11685, 11702, 11783, 11783, 11659, 11647, 11610, 11526, 11577, 11538, 11536, 11497,
    11480, 11374, 11234, 11433, 11466, 11475, 11147, 11376, 11217, 11002, 11245, 11124, 11000, 11129, 10923,
    10966, 11071, 11029, 11036, 10972, 11012, 10800, 10936, 10904, 10750, 10669, 10766, 10780, 10675, 10905,
    10511, 10598, 10583, 10658, 10471, 10667, 10601, 10430, 10440, 10510, 10148, 10468, 10346, 10257, 10286,
    10235, 10351, 10182, 10182, 10095, 10192, 9866, 10070, 10148, 9956, 10132, 10043, 9741, 10003, 10056, 9920,
    10021, 9838, 9854, 9740, 9782, 9799, 9798, 9788, 9840, 9747, 9797, 9893, 9593, 9535, 9658, 9554, 9593,
    9530, 9523, 9488, 9548, 9418, 9418, 9508, 9638, 9521, 9277, 9289, 9255, 9322, 9281, 9351, 9259, 9255, 9225,
    9098, 9268, 9227, 9224, 9106, 9239, 3815044,
]  # fmt: skip


def lognormal_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.5, 0.9, n), 1, 4096).astype(np.int64)


def histogram_shapes(total: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Counts for lengths 0..512 of a few shapes with `total` items (Wikipedia is rescaled if smaller)."""
    rng = np.random.default_rng(seed)
    sizes = np.arange(513)
    shapes: dict[str, np.ndarray] = {}
    wiki = np.array([0, *WIKIPEDIA_512], dtype=np.float64)
    shapes["wikipedia-512 (Krell et al.)"] = wiki if total >= wiki.sum() else wiki * total / wiki.sum()

    def with_full_quarter(weights: np.ndarray) -> np.ndarray:
        weights = weights.astype(np.float64)
        weights[0] = 0
        weights[512] = 0
        weights = weights / weights.sum() * 0.75
        weights[512] = 0.25
        return weights * total

    shapes["quarter-full, uniform below"] = with_full_quarter(np.ones(513))
    shapes["quarter-full, lognormal below"] = with_full_quarter(
        np.exp(-((np.log(sizes + 1) - 4.5) ** 2) / 0.8)
    )
    shapes["quarter-full, short-heavy below"] = with_full_quarter(np.exp(-sizes / 60.0))
    shapes["no full, triangular"] = (512 - sizes).astype(np.float64) * (sizes > 0) * total / (512 * 511 / 2)
    # deterministic integer counts: floor plus a seeded spread of the remainder
    result = {}
    for name, expected in shapes.items():
        counts = np.floor(expected).astype(np.int64)
        counts[0] = 0
        missing = round(float(expected.sum())) - int(counts.sum())
        if missing > 0:
            extra = rng.choice(np.arange(1, 513), size=missing, p=expected[1:] / expected[1:].sum())
            counts += np.bincount(extra, minlength=513)
        result[name] = counts
    return result


@dataclass(frozen=True)
class Timing:
    warmup_s: float  # first call: includes numba JIT compilation or loading it from the cache
    median_s: float  # wall clock, median of the repeats
    cpu_median_s: float  # process CPU time, median of the repeats: less sensitive to a loaded machine


def timed(fn: Callable[[], object], repeats: int) -> tuple[object, Timing]:
    """Run `fn` once to warm up, then `repeats` times; returns the last result and the timings."""
    start, start_cpu = time.perf_counter(), time.process_time()
    result = fn()
    warmup, warmup_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    walls, cpus = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - start_cpu)
    if not walls:
        return result, Timing(warmup, warmup, warmup_cpu)
    return result, Timing(warmup, statistics.median(walls), statistics.median(cpus))


def check_lists(bins: list, lengths: np.ndarray, capacity: int, *, values: bool = False) -> int:
    """Validate a peer's list-of-bins output; returns the bin count."""
    if values:  # `binpacking` returns the lengths themselves
        loads = [sum(b) for b in bins]
        placed = sum(len(b) for b in bins)
    else:
        flat = np.fromiter((i for b in bins for i in b), dtype=np.int64)
        assert np.array_equal(np.sort(flat), np.arange(len(lengths))), "items lost or repeated"
        loads = [int(lengths[list(b)].sum()) for b in bins] if len(bins) < 50_000 else []
        placed = len(flat)
    assert placed == len(lengths) and all(load <= capacity for load in loads), "invalid packing"
    return len(bins)


def check_result(result: PackResult, lengths: np.ndarray, capacity: int, max_items: int | None = None) -> int:
    """Validate an mmpack result (every item placed once, no bin over capacity or cap); returns bins."""
    assert np.array_equal(result.bin_ids == -1, lengths > capacity), "wrong rejects"
    placed = result.bin_ids >= 0
    loads = np.bincount(result.bin_ids[placed], weights=lengths[placed], minlength=result.num_bins)
    assert loads.max(initial=0) <= capacity and np.all(loads > 0), "bin over capacity or empty"
    if max_items is not None:
        assert np.bincount(result.bin_ids[placed]).max(initial=0) <= max_items, "item cap broken"
    return result.num_bins


def run_lognormal(args: argparse.Namespace, rows: list[dict]) -> None:
    import binpacking
    import lightbinpack

    capacity = 4096
    for n in args.sizes:
        lengths = lognormal_lengths(n)
        bound = lower_bound_l2(lengths, capacity)
        as_list = lengths.tolist()
        entries: list[tuple[str, Callable[[], object], Callable[[object], int]]] = []
        for algorithm in args.algorithms:
            entries.append(
                (
                    f"mmpack {algorithm}",
                    lambda a=algorithm, x=lengths: pack_lengths(x, capacity, algorithm=a),
                    lambda r, x=lengths: check_result(r, x, capacity),
                )
            )
        for name in ("obfd", "ffd", "nf"):
            fn = getattr(lightbinpack, name)
            entries.append((f"lightbinpack {name}", lambda f=fn, x=as_list: f(x, capacity), lambda r: len(r)))
        for label, fn, count in entries:
            result, timing = timed(fn, args.repeats)
            if label.startswith("lightbinpack"):
                check_lists(result, lengths, capacity)
            rows.append(_row("lognormal", label, lengths, capacity, count(result), bound, timing))
            print(_format(rows[-1]), flush=True)
        del as_list, entries
        small = lengths[: args.binpacking_n]
        small_bound = lower_bound_l2(small, capacity)
        small_list = small.tolist()
        result, timing = timed(lambda s=small_list: binpacking.to_constant_volume(s, capacity), 0)
        rows.append(
            _row(
                "lognormal",
                "binpacking to_constant_volume",
                small,
                capacity,
                check_lists(result, small, capacity, values=True),
                small_bound,
                timing,
            )
        )
        print(_format(rows[-1]), flush=True)
        for label, fn in (
            ("mmpack auto", lambda x=small: pack_lengths(x, capacity)),
            ("lightbinpack obfd", lambda x=small_list: lightbinpack.obfd(x, capacity)),
        ):
            result, timing = timed(fn, args.repeats)
            count = check_result(result, small, capacity) if isinstance(result, PackResult) else len(result)
            rows.append(_row("lognormal", label, small, capacity, count, small_bound, timing))
            print(_format(rows[-1]), flush=True)


def real_image_counts(n: int, seed: int = 2) -> np.ndarray | None:
    """Images per sample resampled from the held-in real records, or None when they are absent."""
    if not REAL_RECORDS.exists():
        return None
    records = json.loads(REAL_RECORDS.read_text())
    counts = np.array([len(r.get("images") or ([r["image"]] if r.get("image") else [])) for r in records])
    return np.random.default_rng(seed).choice(counts, size=n).astype(np.int64)


def run_image_caps(args: argparse.Namespace, rows: list[dict]) -> None:
    capacity = 4096
    for n in args.sizes[:1]:
        lengths = lognormal_lengths(n)
        sources = {"poisson(0.7)": np.random.default_rng(1).poisson(0.7, n).astype(np.int64)}
        real = real_image_counts(n)
        if real is not None:
            sources["mllm_demo counts"] = real
        for source, images in sources.items():
            for cap, max_items in ((2, None), (4, None), (8, None), (4, 6)):
                bound = lower_bound_images(lengths, images, capacity, cap, max_items)
                lp = image_cap_lp_columns(args, lengths, images, capacity, cap, max_items)
                kept = (lengths <= capacity) & (images <= cap)
                section = f"images {source}, cap {cap}" + (f", max {max_items}/bin" if max_items else "")
                for algorithm in ("auto", "obfd", "ffd"):
                    result, timing = timed(
                        lambda a=algorithm, c=cap, m=max_items, i=images, x=lengths: pack_lengths(
                            x,
                            capacity,
                            algorithm=a,
                            image_counts=i,
                            max_images_per_bin=c,
                            max_items_per_bin=m,
                        ),
                        args.repeats,
                    )
                    assert isinstance(result, PackResult)
                    bins = check_result(result, np.where(kept, lengths, capacity + 1), capacity, max_items)
                    placed = result.bin_ids >= 0
                    per_bin = np.bincount(result.bin_ids[placed], weights=images[placed], minlength=bins)
                    assert per_bin.max(initial=0) <= cap, "image cap broken"
                    row = _row(section, f"mmpack {algorithm}", lengths[kept], capacity, bins, bound, timing)
                    row["chosen"] = result.algorithm
                    row |= lp if algorithm == "auto" else {}
                    rows.append(row)
                    print(_format(row) + (f"  LP: {lp}" if algorithm == "auto" and lp else ""), flush=True)


def image_cap_lp_columns(
    args: argparse.Namespace,
    lengths: np.ndarray,
    images: np.ndarray,
    capacity: int,
    cap: int,
    max_items: int | None,
) -> dict:
    """With --lp: the configuration-LP bound (lengths rounded down) and the LP optimum with lengths rounded up
    (bin contents that fit the real samples: what rounding an LP solution would approach), by column generation
    at most --lp-rounds rounds."""
    if not args.lp:
        return {}
    from mmpack.packing.stats import image_cap_lp, lower_bound_images_lp

    units, rounds = args.lp_units, args.lp_rounds
    farley, master = image_cap_lp(
        lengths, images, capacity, cap, max_items, length_units=units, round_up=True, max_rounds=rounds
    )
    return {
        "lp_lower_bound": lower_bound_images_lp(
            lengths, images, capacity, cap, max_items, length_units=units, max_rounds=rounds
        ),
        # converged when the two agree; until then the LP optimum lies between them
        "lp_rounded_up_farley": round(farley, 1),
        "lp_rounded_up_master": round(master, 1),
        "lp_length_units": units,
    }


def run_histograms(args: argparse.Namespace, rows: list[dict]) -> None:
    import lightbinpack

    capacity = 512
    rng = np.random.default_rng(1)
    for shape, counts in histogram_shapes(args.histogram_items).items():
        lengths = np.repeat(np.arange(capacity + 1), counts)
        rng.shuffle(lengths)
        bound = lower_bound_l2(lengths, capacity)
        runs: list[tuple[str, dict[str, Any]]] = [
            ("mmpack auto", {}),
            ("mmpack obfd", {"algorithm": "obfd"}),
            ("mmpack auto, max 3/bin", {"max_items_per_bin": 3}),
            ("mmpack obfd, max 3/bin", {"algorithm": "obfd", "max_items_per_bin": 3}),
        ]
        for label, kwargs in runs:
            result, timing = timed(lambda kw=kwargs, x=lengths: pack_lengths(x, capacity, **kw), args.repeats)
            cap = kwargs.get("max_items_per_bin")
            bins = check_result(result, lengths, capacity, cap)
            row_bound = bound if cap is None else max(bound, lower_bound_item_cap(lengths, capacity, cap))
            row = _row(f"histogram: {shape}", label, lengths, capacity, bins, row_bound, timing)
            row["chosen"] = result.algorithm
            rows.append(row)
            print(_format(row), flush=True)
        if args.peers_on_histograms and shape.startswith("wikipedia"):
            as_list = lengths.tolist()
            result, timing = timed(
                lambda s=as_list: lightbinpack.obfd(s, capacity), max(1, args.repeats // 2)
            )
            rows.append(
                _row(
                    f"histogram: {shape}",
                    "lightbinpack obfd",
                    lengths,
                    capacity,
                    check_lists(result, lengths, capacity),
                    bound,
                    timing,
                )
            )
            print(_format(rows[-1]), flush=True)
            del as_list, result


def _row(
    section: str, label: str, lengths: np.ndarray, capacity: int, bins: int, bound: int, timing: Timing
) -> dict:
    tokens = int(lengths[lengths <= capacity].sum())
    return {
        "section": section,
        "algorithm": label,
        "n": len(lengths),
        "bins": int(bins),
        "fill_pct": 100.0 * tokens / (bins * capacity) if bins else 0.0,
        "lower_bound": int(bound),
        "gap_to_bound_pct": 100.0 * (bins - bound) / bound if bound else 0.0,
        "time_median_s": timing.median_s,
        "cpu_median_s": timing.cpu_median_s,
        "warmup_s": timing.warmup_s,
    }


def _format(row: dict) -> str:
    return (
        f"{row['section'][:44]:<44} {row['algorithm']:<30} {row['n']:>10,} {row['bins']:>10,} "
        f"{row['fill_pct']:>8.3f}% {row['gap_to_bound_pct']:>9.4f}% {row['time_median_s']:>9.4f} {row['cpu_median_s']:>8.4f} {row['warmup_s']:>8.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000], help="lognormal sizes"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per entry (median reported)")
    parser.add_argument(
        "--binpacking-n", type=int, default=20_000, help="subsample for the slow binpacking peer"
    )
    parser.add_argument(
        "--histogram-items",
        type=int,
        default=sum(WIKIPEDIA_512),
        help="items per histogram shape (default: the published Wikipedia count, 16,279,552)",
    )
    parser.add_argument("--algorithms", nargs="+", default=["auto", "obfd", "ffd", "nf"])
    parser.add_argument("--no-peers-on-histograms", dest="peers_on_histograms", action="store_false")
    parser.add_argument("--skip-lognormal", action="store_true")
    parser.add_argument("--skip-histograms", action="store_true")
    parser.add_argument("--skip-image-caps", action="store_true")
    parser.add_argument(
        "--lp", action="store_true", help="image caps: also the LP bound and estimate (scipy)"
    )
    parser.add_argument(
        "--lp-units", type=int, default=128, help="--lp: length grid (capacity / units tokens)"
    )
    parser.add_argument("--lp-rounds", type=int, default=1500, help="--lp: column generation rounds at most")
    parser.add_argument(
        "--quick", action="store_true", help="--sizes 100000 --histogram-items 1000000 --repeats 3"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.histogram_items, args.repeats = [100_000], 1_000_000, 3
    load_before = os.getloadavg()
    print(
        f"{'section':<44} {'algorithm':<30} {'n':>10} {'bins':>10} {'fill':>9} {'over_LB':>10} "
        f"{'median_s':>9} {'cpu_s':>8} {'warmup_s':>8}"
    )
    rows: list[dict] = []
    if not args.skip_lognormal:
        run_lognormal(args, rows)
    if not args.skip_image_caps:
        run_image_caps(args, rows)
    if not args.skip_histograms:
        run_histograms(args, rows)
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} on {os.cpu_count()} cores")
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": load_after,
            "python": platform.python_version(),
            "numpy": np.__version__,
            "numba": numba.__version__,
        },
        "notes": (
            "mmpack kernels are single-threaded; peers get a ready Python list; binpacking runs on a subsample; "
            "lower_bound is Martello-Toth L2, and max(L2, item-cap bound) under an item cap; under an image cap "
            "mmpack.packing.stats.lower_bound_images (rejects: samples over the image cap, not counted in n)"
        ),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
