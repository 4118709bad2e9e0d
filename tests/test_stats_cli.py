"""`mmpack stats`: numbers against an independent computation, every input form, datasets (local, S3), plots,
the algorithm comparison, and clear errors (exit code 2) on bad input."""

from __future__ import annotations

import io
import json
import math
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from mmpack.cli import main
from mmpack.offline_packing.stats.inputs import StatsInputError, read_length_file
from mmpack.packing.format import FORMAT_NAME, FORMAT_VERSION, bin_key, shard_name
from tests.support import reference

# ---------------------------------------------------------------------------------------------------------
# independent computations (written from the definitions, not from mmpack.packing.stats)


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


def caps_bound(lengths: np.ndarray, capacity: int, max_items: int) -> int:
    """The bound under an item cap: L2 or the item-cap bound of tests.support.reference, whichever is larger."""
    fits = [int(x) for x in lengths if x <= capacity]
    return max(l2_bound(lengths, capacity), reference.lower_bound_item_cap(fits, capacity, max_items))


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
    from mmpack.packing.binpack import pack_lengths

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


# ---------------------------------------------------------------------------------------------------------
# length files through the CLI: numbers equal the independent computation


@pytest.mark.parametrize("form", ["names", "ints", "json", "npy"])
def test_cli_length_file_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str], form: str) -> None:
    path = write_forms(tmp_path, LENGTHS)[form]
    report = run_json(capsys, str(path), "--capacity", str(CAPACITY))
    check_against_independent(report, LENGTHS, pack(LENGTHS, CAPACITY), CAPACITY)
    assert report["num_samples"] == LENGTHS.size
    assert report["source"]["path"] == str(path)
    dist = report["length_distribution"]
    assert dist["min"] == LENGTHS.min() and dist["max"] == LENGTHS.max()
    assert sum(band["samples"] for band in dist["bands"]) == LENGTHS.size
    assert sum(band["token_share"] for band in dist["bands"]) == pytest.approx(1.0)


def test_json_is_packing_stats_plus_extra_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mmpack.packing.stats import packing_stats

    path = write_forms(tmp_path, LENGTHS)["json"]
    report = run_json(capsys, str(path), "--capacity", str(CAPACITY), "--max-samples-per-bin", "2")
    direct = packing_stats(LENGTHS, pack(LENGTHS, CAPACITY, max_items_per_bin=2), CAPACITY)
    direct = json.loads(json.dumps(direct, default=lambda v: v.item() if hasattr(v, "item") else v.tolist()))
    assert {k: report[k] for k in direct} == direct
    assert set(report) - set(direct) == {"source", "length_distribution"}
    assert report["samples_per_bin"]["max"] <= 2
    assert report["source"]["max_samples_per_bin"] == 2
    assert report["source"]["caps_lower_bound_bins"] == caps_bound(LENGTHS, CAPACITY, 2)
    assert report["num_bins"] >= report["source"]["caps_lower_bound_bins"]


def test_histogram_input_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = [0] * 64
    counts[63], counts[31], counts[20], counts[9], counts[2] = 5, 7, 3, 4, 11  # lengths 64, 32, 21, 10, 3
    path = tmp_path / "hist.json"
    path.write_text(json.dumps({"max_len": 64, "counts": counts}))
    report = run_json(capsys, str(path), "--capacity", "64")
    lengths = np.repeat(np.arange(1, 65), counts)
    check_against_independent(report, lengths, pack(lengths, 64), 64)
    assert report["source"]["kind"] == "histogram"
    assert report["num_samples"] == sum(counts)


def test_image_caps_are_honoured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images = np.array([2, 0, 1, 3, 1, 1, 0, 2, 1, 0, 1, 1, 2, 0, 1])
    path = tmp_path / "with_images.json"
    path.write_text(json.dumps({"lengths": LENGTHS.tolist(), "image_counts": images.tolist()}))
    report = run_json(capsys, str(path), "--capacity", str(CAPACITY), "--max-images-per-bin", "3")
    bin_ids = pack(LENGTHS, CAPACITY, image_counts=images, max_images_per_bin=3)
    check_against_independent(report, LENGTHS, bin_ids, CAPACITY, images)
    assert report["images_per_bin"]["max"] <= 3


def test_samples_longer_than_capacity_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lengths = np.array([100, 5000, 300, 900, 4097, 20])
    path = tmp_path / "long.json"
    path.write_text(json.dumps(lengths.tolist()))
    report = run_json(capsys, str(path), "--capacity", "1024")
    bin_ids = pack(lengths, 1024)
    assert (bin_ids[[1, 4]] == -1).all()
    check_against_independent(report, lengths, bin_ids, 1024)
    over = [b for b in report["length_distribution"]["bands"] if b["range"].startswith(">")]
    assert over[0]["samples"] == 2


def test_table_output_is_readable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_forms(tmp_path, LENGTHS)["ints"]
    rc, out, err = run_stats(capsys, str(path), "--capacity", str(CAPACITY))
    assert rc == 0, err
    bin_ids = pack(LENGTHS, CAPACITY)
    want = expected_stats(LENGTHS, bin_ids, CAPACITY)
    for label in (
        "samples",
        "bins",
        "fill efficiency",
        "L1 lower bound",
        "L2 lower bound",
        "padding compression",
        "samples per bin",
        "images per bin",
        "Fill histogram",
        "Sample lengths",
        "95-100%",
    ):
        assert label in out, label
    assert f"{100 * want['fill_efficiency']:.3f}%" in out
    assert (
        f"{want['l2_lower_bound_bins']:,} bins (gap {want['num_bins'] - want['l2_lower_bound_bins']:+,} bins"
        in out
    )
    assert "\x1b[" not in out  # no colour codes when not a terminal


# ---------------------------------------------------------------------------------------------------------
# plot and compare


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.0, 0.8, 3000), 1, 4096).astype(np.int64)
    src = tmp_path / "lens.npy"
    np.save(src, lengths)
    out = tmp_path / "plots" / "stats.png"
    rc, _, err = run_stats(capsys, str(src), "--capacity", "4096", "--plot", str(out))
    assert rc == 0, err
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # three panels with axes and bars, not an empty canvas
    from PIL import Image

    with Image.open(out) as image:
        assert image.size[0] > 1000 and image.size[1] > 300


def test_compare_lists_every_algorithm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mmpack.packing import binpack

    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 512, 400)
    path = tmp_path / "lens.json"
    path.write_text(json.dumps(lengths.tolist()))
    report = run_json(capsys, str(path), "--capacity", "512", "--compare", "--max-samples-per-bin", "3")
    rows = report["compare"]
    algorithms = [str(a) for a in binpack.ALGORITHMS]
    assert [(r["algorithm"], r["max_samples_per_bin"]) for r in rows] == [(a, None) for a in algorithms] + [
        (a, 3) for a in algorithms
    ]
    l2 = l2_bound(lengths, 512)
    for row in rows:
        assert "error" not in row, row
        bin_ids = pack(lengths, 512, algorithm=row["algorithm"], max_items_per_bin=row["max_samples_per_bin"])
        assert row["num_bins"] == int(bin_ids.max()) + 1
        assert row["num_bins"] >= l2 and row["l2_lower_bound_bins"] == l2
        assert row["gap_to_l2_bins"] == row["num_bins"] - l2
        assert row["fill_efficiency"] == pytest.approx(lengths.sum() / (row["num_bins"] * 512))
        assert row["time_s"] >= 0
        if row["max_samples_per_bin"] == 3:
            assert row["caps_lower_bound_bins"] == caps_bound(lengths, 512, 3) <= row["num_bins"]
        else:
            assert "caps_lower_bound_bins" not in row
    rc, out, _ = run_stats(capsys, str(path), "--capacity", "512", "--compare")
    assert rc == 0 and "Algorithms on the same lengths" in out
    assert all(a in out for a in algorithms)


# ---------------------------------------------------------------------------------------------------------
# bad input: a clear message naming the file (and line), exit code 2


def bad_input_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n# only a comment\n")
    non_int = tmp_path / "nonint.txt"
    non_int.write_text("a:10\nb:20\nc:twelve\n")
    negative = tmp_path / "neg.lens"
    negative.write_text("10\n20\n\n-5\n")
    zero_json = tmp_path / "zero.json"
    zero_json.write_text("[3, 0, 4]")
    float_json = tmp_path / "float.json"
    float_json.write_text("[3, 4.5]")
    bad_hist = tmp_path / "hist.json"
    bad_hist.write_text(json.dumps({"max_len": 4, "counts": [1, 2]}))
    neg_npy = tmp_path / "neg.npy"
    np.save(neg_npy, np.array([5, -1, 3]))
    no_manifest = tmp_path / "not_a_dataset"
    no_manifest.mkdir()
    no_suffix = tmp_path / "lengths"
    no_suffix.write_text("1\n2\n")
    unknown = tmp_path / "lengths.csv"
    unknown.write_text("1,2,3\n")
    cap = ["--capacity", "64"]
    return [
        ([str(empty), *cap], f"{empty}: no lengths found"),
        ([str(non_int), *cap], f"{non_int}:3: expected `name:length` or an integer, got 'c:twelve'"),
        ([str(negative), *cap], f"{negative}:4: sample length must be a positive integer, got -5"),
        ([str(zero_json), *cap], f"{zero_json}: lengths[1] must be a positive integer, got 0"),
        ([str(float_json), *cap], f"{float_json}: lengths[1] must be an integer, got 4.5"),
        ([str(bad_hist), *cap], f"{bad_hist}: histogram 'counts' must have max_len=4 entries"),
        ([str(neg_npy), *cap], f"{neg_npy}: length at index 1 must be a positive integer, got -1"),
        ([str(no_manifest)], f"{no_manifest}: no manifest.json found"),
        ([str(unknown), *cap], f"{unknown}: unknown file type '.csv'"),
        ([str(tmp_path / "missing.txt"), *cap], f"{tmp_path / 'missing.txt'}: no such file"),
        (
            [str(tmp_path / "missing_dir")],
            f"{tmp_path / 'missing_dir'}: no such dataset folder or length file",
        ),
        ([str(no_suffix), *cap], f"{no_suffix}: unknown file type '(no suffix)'"),
        ([str(non_int)], f"{non_int}: a length file needs --capacity"),
        ([str(negative), "--capacity", "0"], "--capacity must be a positive integer, got 0"),
        (
            [str(zero_json).replace("zero", "x"), "--capacity", "8", "--plot", "out.jpg"],
            "--plot writes a PNG",
        ),
        (
            [str(negative).replace("neg", "ok"), "--capacity", "8", "--max-images-per-bin", "2"],
            "needs image counts",
        ),
    ]


USAGE_MESSAGES = ("needs --capacity", "--capacity must be", "--plot writes a PNG", "needs image counts")


def test_bad_inputs_exit_1_with_clear_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad files: exit code 1; flags that do not fit: 2 (as argparse's own errors); one line each."""
    (tmp_path / "ok.lens").write_text("3\n4\n")
    codes = []
    for args, message in bad_input_cases(tmp_path):
        rc, out, err = run_stats(capsys, *args)
        codes.append(rc)
        assert rc == (2 if any(u in message for u in USAGE_MESSAGES) else 1), (args, err)
        assert err.count("\n") == 1 and "Traceback" not in err
        assert message in err, (message, err)
        assert err.startswith("mmpack stats: error: ")
        assert out == ""
    assert codes.count(2) == 4 and codes.count(1) == len(codes) - 4  # control: both kinds are among the cases


def test_parse_errors_are_stats_input_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text("1\n2\nx y\n")
    with pytest.raises(StatsInputError, match=r"bad\.txt:3:"):
        read_length_file(str(path))


# ---------------------------------------------------------------------------------------------------------
# packed datasets written by hand to the on-disk contract (packing/format.py), so every number is known

TINY_JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 20_000  # opaque image payload: only its size matters here

# bins of a tiny dataset: per bin, (seq_lens, image grids (t, h, w) in patches)
TINY_BINS: list[tuple[list[int], list[tuple[int, int, int]]]] = [
    ([60, 40], [(1, 4, 4)]),
    ([100], []),
    ([30, 30, 30], [(1, 2, 2), (1, 4, 8)]),
    ([90, 5], [(1, 2, 4)]),
    ([70], [(1, 8, 8)]),
]
TINY_SEQ_LEN = 100


def _bin_record(prefix: str, index: int, seq_lens: list[int], grids: list[tuple[int, int, int]]) -> dict:
    return {
        "key": bin_key(prefix, index),
        "input_ids": np.arange(sum(seq_lens), dtype=np.uint32) % 7,
        "loss_mask": np.ones(sum(seq_lens), dtype=np.uint8),
        "seq_lens": np.asarray(seq_lens, dtype=np.int32),
        "sample_ids": [f"s{index}-{j}" for j in range(len(seq_lens))],
        "images": [TINY_JPEG] * len(grids),
        "image_formats": ["jpg"] * len(grids),
        "image_grid_thw": np.asarray(grids, dtype=np.int32).reshape(-1, 3),
    }


def _write_arrow(path: Path, records: list[dict]) -> None:
    schema = pa.schema(
        [
            ("key", pa.string()),
            ("input_ids", pa.list_(pa.uint32())),
            ("loss_mask", pa.list_(pa.uint8())),
            ("seq_lens", pa.list_(pa.int32())),
            ("sample_ids", pa.list_(pa.string())),
            ("images", pa.list_(pa.binary())),
            ("image_formats", pa.list_(pa.string())),
            ("image_grid_thw", pa.list_(pa.list_(pa.int32(), 3))),
        ]
    )
    columns = {
        name: [r[name].tolist() if isinstance(r[name], np.ndarray) else r[name] for r in records]
        for name in schema.names
    }
    table = pa.table(columns, schema=schema)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)


def _write_wds(path: Path, records: list[dict]) -> None:
    with tarfile.open(path, "w") as tar:
        for r in records:
            members: list[tuple[str, bytes]] = [
                (
                    f"{r['key']}.json",
                    json.dumps(
                        {
                            "key": r["key"],
                            "sample_ids": r["sample_ids"],
                            "image_formats": r["image_formats"],
                            "n_images": len(r["images"]),
                        }
                    ).encode(),
                )
            ]
            for field in ("input_ids", "loss_mask", "seq_lens", "image_grid_thw"):
                buf = io.BytesIO()
                np.save(buf, r[field])
                members.append((f"{r['key']}.{field}.npy", buf.getvalue()))
            members += [(f"{r['key']}.img{i}.jpg", img) for i, img in enumerate(r["images"])]
            for name, data in sorted(members):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def write_tiny_dataset(
    root: Path,
    bins=TINY_BINS,
    shard_bins: tuple[int, ...] = (2, 3),
    formats: tuple[str, ...] = ("arrow", "wds"),
    counts_override: dict | None = None,
) -> Path:
    """A packed dataset with the given bins split into shards; manifest counts computed from the bins."""
    (root / "shards").mkdir(parents=True)
    prefix = "tiny"
    records = [_bin_record(prefix, i, sl, g) for i, (sl, g) in enumerate(bins)]
    shards, first = [], 0
    for s, n in enumerate(shard_bins):
        part = records[first : first + n]
        for fmt in formats:
            rel = shard_name(prefix, s, fmt)
            (_write_arrow if fmt == "arrow" else _write_wds)(root / rel, part)
            shards.append(
                {
                    "path": rel,
                    "format": fmt,
                    "first_bin": first,
                    "bins": n,
                    "samples": sum(len(r["seq_lens"]) for r in part),
                    "tokens": int(sum(r["seq_lens"].sum() for r in part)),
                    "bytes": (root / rel).stat().st_size,
                    "sha256": "0" * 64,
                }
            )
        first += n
    samples = sum(len(sl) for sl, _ in bins)
    counts = {
        "samples_read": samples + 2,
        "samples_packed": samples,
        "samples_rejected": 2,
        "rejected_by_reason": {"missing_image": 1, "too_long": 1},
        "bins": len(bins),
        "tokens": sum(sum(sl) for sl, _ in bins),
        "image_tokens": 0,
    }
    counts.update(counts_override or {})
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "seq_len": TINY_SEQ_LEN,
        "formats": list(formats),
        "tokenizer": {
            "name": "tiny-bpe",
            "sha256": "",
            "is_fallback": False,
            "vocab_size": 300,
            "special_ids": {},
        },
        "image_rule": {"patch_size": 14, "merge_size": 2, "min_pixels": 3136, "max_pixels": 12845056},
        "chat_template": {},
        "algorithm": {"name": "obfd", "max_items_per_bin": None, "max_images_per_bin": None},
        "seed": 0,
        "counts": counts,
        "shards": shards,
        "created_by": "mmpack test",
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return root


def tiny_expected() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lengths = np.array([n for sl, _ in TINY_BINS for n in sl])
    bin_ids = np.array([b for b, (sl, _) in enumerate(TINY_BINS) for _ in sl])
    images = np.array([len(g) if j == 0 else 0 for sl, g in TINY_BINS for j in range(len(sl))])
    return lengths, bin_ids, images


@pytest.mark.parametrize("fmt", ["arrow", "wds"])
def test_dataset_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    root = write_tiny_dataset(tmp_path / "ds")
    report = run_json(capsys, str(root), "--format", fmt)
    lengths, bin_ids, images = tiny_expected()
    check_against_independent(report, lengths, bin_ids, TINY_SEQ_LEN, images)
    assert report["num_samples"] == 9 and report["num_bins"] == 5 and report["total_tokens"] == 455
    assert report["images_per_bin"]["max"] == 2
    ds = report["dataset"]
    assert ds["format"] == fmt and ds["seq_len"] == TINY_SEQ_LEN and ds["warnings"] == []
    assert ds["counts"]["rejected_by_reason"] == {"missing_image": 1, "too_long": 1}
    # image tokens: t*h*w / merge**2 per image = 4 + 1 + 8 + 2 + 16
    assert ds["image_tokens"] == 31
    assert [(s["bins"], s["samples"], s["tokens"], s["images"]) for s in ds["shards"]] == [
        (2, 3, 200, 1),
        (3, 6, 255, 4),
    ]
    assert ds["shards"][0]["fill_efficiency"] == pytest.approx(200 / 200)
    assert ds["shards"][1]["fill_efficiency"] == pytest.approx(255 / 300)
    assert all(s["path"].endswith(".arrow" if fmt == "arrow" else ".tar") for s in ds["shards"])


def test_dataset_manifest_path_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write_tiny_dataset(tmp_path / "ds", formats=("wds",))
    rc, out, err = run_stats(capsys, str(root / "manifest.json"))
    assert rc == 0, err
    for text in (
        "Dataset",
        "tiny-bpe",
        "missing_image: 1",
        "Shards (wds, 2)",
        "shards/tiny-000001.tar",
        "total",
        "91.000%",
    ):  # 455 tokens / (5 bins * 100)
        assert text in out, text


def test_dataset_workers_are_capped_like_every_worker_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--workers 99999` on two shards starts no more readers than the machine gives the job (one CPU here)."""
    from mmpack.offline_packing.engines import workers
    from mmpack.offline_packing.stats import dataset

    root = write_tiny_dataset(tmp_path / "ds")
    started: list[int] = []
    pool = dataset.ThreadPoolExecutor

    def recorded(max_workers: int) -> Any:
        started.append(max_workers)
        return pool(max_workers=max_workers)

    monkeypatch.setattr(dataset, "ThreadPoolExecutor", recorded)
    monkeypatch.setattr(workers, "machine_workers", lambda: 1)
    assert run_json(capsys, str(root), "--workers", "99999")["num_bins"] == 5
    assert started == [1]


def test_dataset_inconsistent_manifest_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write_tiny_dataset(tmp_path / "ds", counts_override={"bins": 6})
    report = run_json(capsys, str(root))
    assert report["dataset"]["warnings"] == ["manifest counts.bins=6, shards hold 5"]
    rc, out, _ = run_stats(capsys, str(root))
    assert rc == 0 and "warning: manifest counts.bins=6, shards hold 5" in out


def test_dataset_missing_shard_and_bad_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write_tiny_dataset(tmp_path / "ds", formats=("arrow",))
    (root / "shards" / "tiny-000001.arrow").unlink()
    rc, _, err = run_stats(capsys, str(root))
    assert rc == 1 and "shard shards/tiny-000001.arrow listed in the manifest is missing" in err
    (root / "shards" / "tiny-000001.arrow").write_bytes(b"not an arrow file" * 10)
    rc, _, err = run_stats(capsys, str(root))
    assert rc == 1 and "cannot read shard shards/tiny-000001.arrow" in err
    wds_root = write_tiny_dataset(tmp_path / "wds", formats=("wds",))
    (wds_root / "shards" / "tiny-000000.tar").write_bytes(b"\x00garbage" * 100)
    rc, _, err = run_stats(capsys, str(wds_root))
    assert rc == 1 and "cannot read shard shards/tiny-000000.tar" in err
    (root / "manifest.json").write_text('{"format": "something-else"}')
    rc, _, err = run_stats(capsys, str(root))
    assert rc == 1 and "not an mmpack packed dataset manifest (format='something-else'" in err
    rc, _, err = run_stats(capsys, str(root), "--format", "wds")
    assert rc == 1


def test_dataset_with_a_shard_path_outside_the_root_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_tiny_dataset(tmp_path / "ds", formats=("arrow",))
    assert run_stats(capsys, str(root))[0] == 0  # control
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["shards"][1]["path"] = "../../etc/passwd"
    (root / "manifest.json").write_text(json.dumps(manifest))
    rc, _, err = run_stats(capsys, str(root))
    assert rc == 1 and "shards[1]" in err and "'../../etc/passwd'" in err


def test_dataset_compare_includes_the_stored_packing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_tiny_dataset(tmp_path / "ds", formats=("arrow",))
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["algorithm"]["max_items_per_bin"] = 3
    (root / "manifest.json").write_text(json.dumps(manifest))
    report = run_json(capsys, str(root), "--compare")
    lengths, _, _ = tiny_expected()
    l2 = l2_bound(lengths, TINY_SEQ_LEN)
    bound = caps_bound(lengths, TINY_SEQ_LEN, 3)
    assert bound >= l2 and report["source"]["caps_lower_bound_bins"] == bound
    rows = report["compare"]
    assert rows[0]["algorithm"] == "as packed" and rows[0]["num_bins"] == 5
    assert rows[0]["max_samples_per_bin"] == 3 and rows[0]["caps_lower_bound_bins"] == bound
    # without caps, then with the dataset's own cap of 3 samples per bin
    assert [r["max_samples_per_bin"] for r in rows[1:]] == [None] * (len(rows) // 2) + [3] * (len(rows) // 2)
    assert all(r["num_bins"] >= l2 for r in rows)
    assert all(r["num_bins"] >= bound for r in rows if r["max_samples_per_bin"] == 3)
    rc, _, err = run_stats(capsys, str(root), "--compare", "--max-images-per-bin", "2")
    assert rc == 2 and "record images per bin, not per sample" in err


def test_dataset_reading_skips_image_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    read_bytes = {"n": 0}

    class Counting(LocalFileSystem):
        protocol = "countfs"

        def _open(self, path, mode="rb", **kwargs):
            f = super()._open(path, mode, **kwargs)
            original = f.read

            def read(n=-1):
                data = original(n)
                read_bytes["n"] += len(data)
                return data

            f.read = read
            return f

    fsspec.register_implementation("countfs", Counting, clobber=True)
    big = [([50, 50], [(1, 4, 4)] * 8)] * 20  # 160 images of 20 kB each
    for fmt in ("arrow", "wds"):
        root = write_tiny_dataset(tmp_path / fmt, bins=big, shard_bins=(20,), formats=(fmt,))
        shard_size = next((root / "shards").iterdir()).stat().st_size
        read_bytes["n"] = 0
        report = run_json(capsys, f"countfs://{root}")
        assert report["num_bins"] == 20 and report["dataset"]["shards"][0]["images"] == 160
        assert shard_size > 3_000_000
        assert 0 < read_bytes["n"] < shard_size / 10, (fmt, read_bytes["n"], shard_size)


# ---------------------------------------------------------------------------------------------------------
# remote datasets: moto's S3 server and a plain HTTP server on 127.0.0.1


from tests.support.storage_servers import http_server, moto_s3  # noqa: E402


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    """moto's S3 server on 127.0.0.1, shared by the tests of this module."""
    with moto_s3() as endpoint:
        yield endpoint


def test_dataset_on_s3(tmp_path: Path, capsys: pytest.CaptureFixture[str], s3: Any) -> None:
    root = write_tiny_dataset(tmp_path / "ds")
    local = run_json(capsys, str(root))
    url = s3.upload_folder(root, "stats-bucket", "datasets/tiny")
    flags = [
        "--endpoint-url",
        s3.endpoint_url,
        "--storage-option",
        "key=testing",
        "--storage-option",
        "secret=testing",
    ]
    for fmt in ("arrow", "wds"):
        remote = run_json(capsys, url, "--format", fmt, *flags)
        local = run_json(capsys, str(root), "--format", fmt)
        assert {k: v for k, v in remote.items() if k not in ("source", "dataset")} == {
            k: v for k, v in local.items() if k not in ("source", "dataset")
        }
        assert remote["source"]["path"] == url
        assert [s["tokens"] for s in remote["dataset"]["shards"]] == [200, 255]
    rc, _, err = run_stats(capsys, "s3://stats-bucket/datasets/nothing-here", *flags)
    assert rc == 1 and "s3://stats-bucket/datasets/nothing-here: no manifest.json found" in err


def test_dataset_over_http(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write_tiny_dataset(tmp_path / "ds")
    local = run_json(capsys, str(root))
    with http_server(root) as base:
        for fmt in ("arrow", "wds"):
            remote = run_json(capsys, base + "/", "--format", fmt)
            assert {k: v for k, v in remote.items() if k not in ("source", "dataset")} == {
                k: v for k, v in local.items() if k not in ("source", "dataset")
            }
            assert remote["dataset"]["shards"] == [
                {
                    **s,
                    "path": s["path"].replace(".arrow", ".tar" if fmt == "wds" else ".arrow"),
                    "format": fmt,
                    "bytes": remote["dataset"]["shards"][i]["bytes"],
                }
                for i, s in enumerate(local["dataset"]["shards"])
            ]


# ---------------------------------------------------------------------------------------------------------
# a dataset written by the real offline job (`run_pack`) from the synthetic raw data


@pytest.fixture(scope="module")
def packed_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmpack.offline_packing.options import job_config
    from mmpack.offline_packing.pipeline import run_pack
    from tests.support.fixtures_data import make_synthetic_dataset, train_tiny_bpe

    root = tmp_path_factory.mktemp("stats_raw")
    data = make_synthetic_dataset(root / "data", n_samples=60, seed=5, size_range=(40, 400), max_words=120)
    out = root / "packed"
    cfg = job_config(
        inputs=(str(data.jsonl_path),),
        output=str(out),
        seq_len=768,
        tokenizer=str(train_tiny_bpe(root / "tok")),
        format="both",
        max_bins_per_shard=4,
        chunk_size=16,
        progress=False,
    )
    run_pack(cfg)
    return out


def test_packed_dataset_from_the_offline_job(
    packed_dataset: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.support.fixtures_data import read_arrow_bins

    manifest = json.loads((packed_dataset / "manifest.json").read_text())
    # independent read of every bin with plain pyarrow (all columns), in manifest shard order
    rows = [
        row
        for shard in manifest["shards"]
        if shard["format"] == "arrow"
        for row in read_arrow_bins(packed_dataset / shard["path"])
    ]
    lengths = np.array([n for row in rows for n in row["seq_lens"]])
    bin_ids = np.array([b for b, row in enumerate(rows) for _ in row["seq_lens"]])
    images = np.array(
        [len(row["image_grid_thw"]) if j == 0 else 0 for row in rows for j in range(len(row["seq_lens"]))]
    )
    by_format = {fmt: run_json(capsys, str(packed_dataset), "--format", fmt) for fmt in ("arrow", "wds")}
    for fmt, report in by_format.items():
        check_against_independent(report, lengths, bin_ids, manifest["seq_len"], images)
        counts = manifest["counts"]
        assert report["num_samples"] == counts["samples_packed"] and report["num_bins"] == counts["bins"]
        assert report["total_tokens"] == counts["tokens"]
        ds = report["dataset"]
        assert ds["warnings"] == [] and ds["format"] == fmt
        assert len(ds["shards"]) == sum(1 for s in manifest["shards"] if s["format"] == fmt)
        assert sum(s["images"] for s in ds["shards"]) == sum(len(r["image_grid_thw"]) for r in rows)
        if "image_tokens" in counts:
            assert ds["image_tokens"] == counts["image_tokens"]
    strip = lambda r: {k: v for k, v in r.items() if k != "dataset"}  # noqa: E731
    assert strip(by_format["arrow"]) == strip(by_format["wds"])


def test_packed_dataset_on_s3_matches_local(
    packed_dataset: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, s3: Any
) -> None:
    local = run_json(capsys, str(packed_dataset))
    url = s3.upload_folder(packed_dataset, "packed", "run1")
    # endpoint and credentials from the environment, as s3fs/botocore users set them
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    remote = run_json(capsys, url + "/")
    assert remote["source"]["path"] == url
    assert {k: v for k, v in remote.items() if k not in ("source", "dataset")} == {
        k: v for k, v in local.items() if k not in ("source", "dataset")
    }
    assert remote["dataset"]["shards"] == local["dataset"]["shards"]


def test_console_script_exit_code(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.txt"
    bad.write_text("12\nnot-a-number\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mmpack", "stats", str(bad), "--capacity", "64"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert f"{bad}:2: expected `name:length` or an integer" in proc.stderr
    assert proc.stdout == ""


def test_unreachable_storage_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    # nothing listens on port 9 of 127.0.0.1: the S3 client cannot connect
    rc, out, err = run_stats(
        capsys,
        "s3://bucket/dataset",
        "--endpoint-url",
        "http://127.0.0.1:9",
        "--storage-option",
        "key=x",
        "--storage-option",
        "secret=y",
        "--storage-option",
        'config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2}',
    )
    assert rc == 1 and out == ""
    assert err.startswith("mmpack stats: error: cannot read s3://bucket/dataset")


@pytest.mark.parametrize("seed", range(6))
def test_random_small_cases_match_independent_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], seed: int
) -> None:
    from mmpack.packing.binpack import ALGORITHMS

    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(8, 200))
    lengths = rng.integers(1, capacity + capacity // 4 + 1, int(rng.integers(1, 120)))  # some too long
    images = rng.integers(0, 4, lengths.size)
    algorithm = str(ALGORITHMS[seed % len(ALGORITHMS)])
    max_items = [None, 1, 2, 5][seed % 4]
    path = tmp_path / "case.json"
    path.write_text(json.dumps({"lengths": lengths.tolist(), "image_counts": images.tolist()}))
    args = [str(path), "--capacity", str(capacity), "--algorithm", algorithm]
    args += ["--max-samples-per-bin", str(max_items)] if max_items else []
    report = run_json(capsys, *args)
    bin_ids = pack(lengths, capacity, algorithm=algorithm, max_items_per_bin=max_items)
    if (bin_ids >= 0).any():
        check_against_independent(report, lengths, bin_ids, capacity, images)
    assert report["num_samples"] + report["num_rejected"] == lengths.size
    assert report["num_rejected"] == int((lengths > capacity).sum())
    if max_items:
        want = caps_bound(lengths, capacity, max_items)
        assert report["source"]["caps_lower_bound_bins"] == want <= report["num_bins"]


def test_file_url_and_shard_rows_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_forms(tmp_path, LENGTHS)["npy"]
    report = run_json(capsys, f"file://{path}", "--capacity", str(CAPACITY))
    assert report["num_samples"] == LENGTHS.size and report["source"]["kind"] == "npy"
    root = write_tiny_dataset(tmp_path / "ds", formats=("arrow",))
    rc, out, err = run_stats(capsys, f"file://{root}", "--max-shard-rows", "1")
    assert rc == 0, err
    assert "shards/tiny-000000.arrow" in out and "shards/tiny-000001.arrow" not in out
    assert "... 1 more" in out


@pytest.mark.slow
def test_text_length_file_is_streamed_with_bounded_memory(tmp_path: Path) -> None:
    import tracemalloc

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 4096, size=1_000_000)
    path = tmp_path / "big.txt"
    with open(path, "w") as f:
        f.write("# comment line\n")
        f.writelines(f"shard-{i // 1000:06d}/sample-{i:09d}:{n}\n" for i, n in enumerate(lengths))
    size = path.stat().st_size

    def peak_of(fn):
        tracemalloc.start()
        try:
            result = fn()
            return result, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    def whole_file():  # the reference: read everything, then parse
        text = path.read_text()
        return np.array([int(x.rpartition(":")[2]) for x in text.splitlines() if not x.startswith("#")])

    expected, whole_peak = peak_of(whole_file)
    got, peak = peak_of(lambda: read_length_file(str(path)))
    np.testing.assert_array_equal(got.lengths, lengths)
    np.testing.assert_array_equal(got.lengths, expected)
    assert whole_peak > size  # control: reading the file whole costs more than the file
    # streamed: the int64 result (8 bytes a line) plus one chunk's worth of parsing
    assert peak < lengths.size * 8 + 12 * (1 << 20) < size, (peak, size)


def test_big_json_length_file_is_refused_with_advice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mmpack.offline_packing.stats.inputs as inputs

    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(list(range(1, 2000))))
    monkeypatch.setattr(inputs, "JSON_MAX_BYTES", 1000)
    with pytest.raises(StatsInputError, match=r"lengths.json: JSON length files are read whole .*\.txt"):
        read_length_file(str(path))
    monkeypatch.setattr(inputs, "JSON_MAX_BYTES", 1 << 20)
    assert read_length_file(str(path)).lengths.size == 1999  # control


def test_bad_line_is_named_across_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mmpack.offline_packing.stats.inputs as inputs

    monkeypatch.setattr(inputs, "CHUNK_BYTES", 64)
    path = tmp_path / "l.txt"
    path.write_text("".join(f"s{i}:{i + 1}\n" for i in range(100)) + "s100:oops\n")
    with pytest.raises(StatsInputError, match=r"l.txt:101: expected"):
        read_length_file(str(path))
    path.write_text("".join(f"s{i}:{i + 1}\n" for i in range(100)))
    np.testing.assert_array_equal(read_length_file(str(path)).lengths, np.arange(1, 101))


def test_debug_shows_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "missing.txt")
    rc, _, err = run_stats(capsys, missing, "--capacity", "8")
    assert (
        rc == 1 and "Traceback" not in err and err.strip() == f"mmpack stats: error: {missing}: no such file"
    )
    rc, _, err = run_stats(capsys, missing, "--capacity", "8", "--debug")
    assert rc == 1 and "Traceback" in err and err.endswith(f"mmpack stats: error: {missing}: no such file\n")
