"""`mmpack view` on large packed datasets: how long until the first page is written, and its size, for 1,000 and
1,000,000 bins (the first page must not grow with the dataset); then the whole report (bin list, sample-id index,
stats). The datasets are synthetic text bins written straight as Arrow shards (the packer's own record-batch
builder), with the demo tokenizer's manifest facts.

    python benchmarks/bench_view.py [--bins 1000 1000000] [--out /tmp/bench_view] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from mmpack.offline_packing.outputs.shard_writers import ARROW_SCHEMA
from mmpack.view.site import ViewOptions, write_view

SEQ_LEN = 64
SAMPLES_PER_BIN = 2
BINS_PER_SHARD = 10_000
BATCH_ROWS = 1_000


def _list(values: np.ndarray, per_row: int, rows: int, dtype: pa.DataType) -> pa.Array:
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * per_row, pa.int32())
    return pa.ListArray.from_arrays(offsets, pa.array(values, dtype))


def _batch(first_bin: int, rows: int, rng: np.random.Generator) -> pa.RecordBatch:
    """`rows` bins of two samples each: <|im_start|> 30 tokens <|im_end|>, the last half of each trained."""
    half = SEQ_LEN // SAMPLES_PER_BIN
    sample = rng.integers(10, 500, size=(rows * SAMPLES_PER_BIN, half), dtype=np.uint32)
    sample[:, 0], sample[:, -1] = 1, 2
    mask = np.zeros_like(sample, dtype=np.uint8)
    mask[:, half // 2 :] = 1
    ids = [f"bench-{first_bin + r}-{s}" for r in range(rows) for s in range(SAMPLES_PER_BIN)]
    empty = pa.array(np.zeros(rows + 1, np.int32), pa.int32())
    columns = [
        pa.array([f"bench-{first_bin + r:09d}" for r in range(rows)], pa.string()),
        _list(sample.reshape(-1), SEQ_LEN, rows, pa.uint32()),
        _list(mask.reshape(-1), SEQ_LEN, rows, pa.uint8()),
        _list(np.full(rows * SAMPLES_PER_BIN, half, np.int32), SAMPLES_PER_BIN, rows, pa.int32()),
        _list(np.array(ids, dtype=object), SAMPLES_PER_BIN, rows, pa.string()),
        pa.ListArray.from_arrays(empty, pa.array([], pa.binary())),
        pa.ListArray.from_arrays(empty, pa.array([], pa.string())),
        pa.ListArray.from_arrays(empty, pa.FixedSizeListArray.from_arrays(pa.array([], pa.int32()), 3)),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)


def build_dataset(root: Path, num_bins: int, seed: int = 0) -> Path:
    """A packed dataset of `num_bins` text bins (manifest version 3, Arrow shards of 10,000 bins)."""
    rng = np.random.default_rng(seed)
    (root / "shards").mkdir(parents=True, exist_ok=True)
    shards = []
    for first in range(0, num_bins, BINS_PER_SHARD):
        bins = min(BINS_PER_SHARD, num_bins - first)
        path = root / "shards" / f"bench-{first // BINS_PER_SHARD:06d}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, ARROW_SCHEMA) as writer:
            for at in range(first, first + bins, BATCH_ROWS):
                writer.write_batch(_batch(at, min(BATCH_ROWS, first + bins - at), rng))
        shards.append(
            {
                "path": f"shards/{path.name}", "format": "arrow", "first_bin": first, "bins": bins,
                "samples": bins * SAMPLES_PER_BIN, "tokens": bins * SEQ_LEN, "bytes": path.stat().st_size,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            }
        )  # fmt: skip
    manifest = {
        "format": "mmpack-packed", "version": 3, "seq_len": SEQ_LEN, "formats": ["arrow"], "shards": shards,
        "tokenizer": {"name": "byte-fallback", "sha256": "", "is_fallback": True, "vocab_size": 263,
                      "special_ids": {"pad": 0, "im_start": 1, "im_end": 2, "vision_start": 3, "vision_end": 4,
                                      "image_pad": 5}},
        "counts": {"samples_read": num_bins * SAMPLES_PER_BIN, "samples_packed": num_bins * SAMPLES_PER_BIN,
                   "samples_rejected": 0, "rejected_by_reason": {}, "bins": num_bins,
                   "tokens": num_bins * SEQ_LEN, "image_tokens": 0, "truncated": 0},
        "created_by": "benchmarks/bench_view.py",
    }  # fmt: skip
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measure(root: Path, out: Path) -> dict:
    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    report = write_view(root, out, ViewOptions(bins=1, progress=False), say=lambda _line: None)
    total = time.perf_counter() - t0
    return {
        "first_page_s": round(report.first_page_s, 3),
        "first_page_bytes": report.first_page_bytes,
        "index_html_bytes": (out / "index.html").stat().st_size,
        "overview_js_bytes": (out / "overview.js").stat().st_size,
        "listing_s": round(report.listing_s, 2),
        "stats_s": round(report.stats_s, 2),
        "total_s": round(total, 2),
        "report_bytes": _size(out),
        "files": sum(1 for p in out.rglob("*") if p.is_file()),
        "problems": report.problems,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bins", type=int, nargs="+", default=[1_000, 1_000_000])
    parser.add_argument("--out", default="/tmp/bench_view")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    base = Path(args.out)
    rows = []
    for n in args.bins:
        t0 = time.perf_counter()
        root = build_dataset(base / f"data-{n}", n)
        built = time.perf_counter() - t0
        rows.append({"bins": n, "build_s": round(built, 1), **measure(root, base / f"view-{n}")})
        shutil.rmtree(root)
    print(
        f"{'bins':>10} {'first page s':>13} {'first page bytes':>17} {'list s':>8} {'stats s':>8} {'all s':>8} "
        f"{'report MB':>10} {'files':>7}"
    )
    for r in rows:
        print(
            f"{r['bins']:>10,} {r['first_page_s']:>13.3f} {r['first_page_bytes']:>17,} {r['listing_s']:>8.1f} "
            f"{r['stats_s']:>8.1f} "
            f"{r['total_s']:>8.1f} "
            f"{r['report_bytes'] / 1e6:>10.1f} {r['files']:>7,}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
