"""`mmpack stats`: numbers against an independent computation, every input form, datasets (local, S3), plots,
the algorithm comparison, and clear errors (exit code 2) on bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from offline_packing.cli import main
from offline_packing.stats_inputs import read_length_file

# ---------------------------------------------------------------------------------------------------------
# independent computations (written from the definitions, not from packing.stats)


def l2_bound(lengths: np.ndarray, capacity: int) -> int:
    """Martello-Toth L2, straight from its definition, for every integer K in [0, C/2]."""
    w = np.asarray(lengths, dtype=np.int64)
    w = w[w <= capacity]
    best = 0
    for k in range(0, capacity // 2 + 1):
        n1 = w[w > capacity - k]
        n2 = w[(w <= capacity - k) & (2 * w > capacity)]
        n3 = w[(2 * w <= capacity) & (w >= k)]
        spare = len(n2) * capacity - int(n2.sum())
        extra = max(0, math.ceil((int(n3.sum()) - spare) / capacity))
        best = max(best, len(n1) + len(n2) + extra)
    return best


def expected_stats(
    lengths: np.ndarray, bin_ids: np.ndarray, capacity: int, images: np.ndarray | None = None
) -> dict:
    """The headline numbers of a packing, computed directly from per-sample bins."""
    lengths = np.asarray(lengths, dtype=np.int64)
    packed = bin_ids >= 0
    num_bins = int(bin_ids.max()) + 1 if packed.any() else 0
    tokens = int(lengths[packed].sum())
    per_bin_samples = [int((bin_ids == b).sum()) for b in range(num_bins)]
    per_bin_tokens = [int(lengths[bin_ids == b].sum()) for b in range(num_bins)]
    per_bin_images = [int(images[bin_ids == b].sum()) if images is not None else 0 for b in range(num_bins)]
    fills = [t / capacity for t in per_bin_tokens]
    edges = [(0.0, 0.5), (0.5, 0.7), (0.7, 0.85), (0.85, 0.95), (0.95, 1.0)]
    hist = [sum(1 for f in fills if lo <= f < hi or (hi == 1.0 and f == 1.0)) for lo, hi in edges]
    return {
        "num_bins": num_bins,
        "total_tokens": tokens,
        "fill_efficiency": tokens / (num_bins * capacity),
        "lower_bound_bins": math.ceil(tokens / capacity),
        "l2_lower_bound_bins": l2_bound(lengths[packed], capacity),
        "padding_compression": (int(packed.sum()) * capacity - tokens) / (num_bins * capacity - tokens)
        if num_bins * capacity > tokens
        else None,
        "samples_per_bin_mean": float(np.mean(per_bin_samples)),
        "samples_per_bin_max": max(per_bin_samples),
        "images_per_bin_max": max(per_bin_images),
        "fill_histogram": hist,
    }


def check_against_independent(
    report: dict, lengths: np.ndarray, bin_ids: np.ndarray, capacity: int, images: np.ndarray | None = None
) -> None:
    want = expected_stats(lengths, bin_ids, capacity, images)
    assert report["capacity"] == capacity
    for key in ("num_bins", "total_tokens", "lower_bound_bins", "l2_lower_bound_bins"):
        assert report[key] == want[key], key
    assert report["fill_efficiency"] == pytest.approx(want["fill_efficiency"], rel=1e-12)
    if want["padding_compression"] is not None:
        assert report["padding_compression"] == pytest.approx(want["padding_compression"], rel=1e-12)
    assert report["samples_per_bin"]["mean"] == pytest.approx(want["samples_per_bin_mean"])
    assert report["samples_per_bin"]["max"] == want["samples_per_bin_max"]
    assert report["images_per_bin"]["max"] == want["images_per_bin_max"]
    hist = report["fill_histogram"]
    assert list(hist.values() if isinstance(hist, dict) else hist) == want["fill_histogram"]


def test_independent_l2_matches_hand_cases() -> None:
    # 3 items of 6 in capacity 10: no two share a bin -> L2 = 3 while L1 = 2
    assert l2_bound(np.array([6, 6, 6]), 10) == 3
    # items 5,5,5,5 fit two per bin -> 2
    assert l2_bound(np.array([5, 5, 5, 5]), 10) == 2
    # 7 + three 4s: no 4 fits next to the 7 (K = 4), the 4s need ceil(12/10) = 2 more -> 3; L1 = 2
    assert l2_bound(np.array([7, 4, 4, 4]), 10) == 3
    # 7 + three 3s: K = 3 leaves 3 free next to the 7 -> 1 + ceil((9 - 3)/10) = 2 = L1
    assert l2_bound(np.array([7, 3, 3, 3]), 10) == 2


# ---------------------------------------------------------------------------------------------------------
# helpers


def run_stats(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["stats", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    rc, out, err = run_stats(capsys, *args, "--json")
    assert rc == 0, err
    return json.loads(out)


LENGTHS = np.array([700, 300, 512, 1024, 90, 90, 400, 880, 60, 1000, 250, 120, 333, 777, 12], dtype=np.int64)
CAPACITY = 1024


def pack(lengths: np.ndarray, capacity: int, **kw: Any) -> np.ndarray:
    from packing.binpack import pack_lengths

    return pack_lengths(lengths, capacity, **kw).bin_ids


# ---------------------------------------------------------------------------------------------------------
# length files: every form parses to the same lengths


def write_forms(tmp_path: Path, lengths: np.ndarray) -> dict[str, Path]:
    forms = {
        "names": tmp_path / "lens.txt",
        "ints": tmp_path / "ints.lens",
        "json": tmp_path / "list.json",
        "npy": tmp_path / "lens.npy",
    }
    forms["names"].write_text(
        "# OV-style name:len lines\n"
        + "".join(f"s3://bucket/img:{i}.jpg:{n}\n" for i, n in enumerate(lengths))
        + "\n"
    )
    forms["ints"].write_text("\n".join(str(n) for n in lengths) + "\n")
    forms["json"].write_text(json.dumps([int(n) for n in lengths]))
    np.save(forms["npy"], lengths.astype(np.int32))
    return forms


def test_every_length_form_parses_to_the_same_lengths(tmp_path: Path) -> None:
    for kind, path in write_forms(tmp_path, LENGTHS).items():
        data = read_length_file(str(path))
        assert data.lengths.tolist() == LENGTHS.tolist(), kind
        assert data.lengths.dtype == np.int64
        assert data.image_counts is None


def test_histogram_form_expands_counts(tmp_path: Path) -> None:
    path = tmp_path / "hist.json"
    path.write_text(json.dumps({"max_len": 5, "counts": [2, 0, 1, 0, 3]}))
    data = read_length_file(str(path))
    assert data.kind == "histogram"
    assert data.lengths.tolist() == [1, 1, 3, 5, 5, 5]


def test_image_counts_from_json_and_npy(tmp_path: Path) -> None:
    images = np.arange(LENGTHS.size) % 3
    as_json = tmp_path / "with_images.json"
    as_json.write_text(json.dumps({"lengths": LENGTHS.tolist(), "image_counts": images.tolist()}))
    as_npy = tmp_path / "with_images.npy"
    np.save(as_npy, np.stack([LENGTHS, images], axis=1))
    for path in (as_json, as_npy):
        data = read_length_file(str(path))
        assert data.lengths.tolist() == LENGTHS.tolist()
        assert data.image_counts is not None and data.image_counts.tolist() == images.tolist()
