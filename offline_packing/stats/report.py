"""Numbers beyond `packing_stats` (length bands, per-shard summary) and the rich tables of `mmpack stats`."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from mmpack.offline_packing.stats.dataset import DatasetPacking
from mmpack.packing.stats import FILL_BUCKETS

FILL_BANDS = tuple(f"{name}%" for name, _, _ in FILL_BUCKETS)
# length bands as fractions of the capacity: (lo, hi] in tokens
_LENGTH_BAND_EDGES = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)


def length_distribution(lengths: np.ndarray, capacity: int) -> dict[str, Any]:
    """Percentiles of the sample lengths and the share of samples and tokens in bands of the capacity."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total_tokens = int(lengths.sum())
    edges = [int(np.floor(f * capacity)) for f in _LENGTH_BAND_EDGES]
    bands = []
    for lo, hi in pairwise(edges):
        bands.append(_band(f"{lo + 1}-{hi}", lengths, (lengths > lo) & (lengths <= hi), total_tokens))
    bands.append(_band(f">{capacity} (not packed)", lengths, lengths > capacity, total_tokens))
    q = np.percentile(lengths, [50, 90, 99]) if lengths.size else np.zeros(3)
    return {
        "min": int(lengths.min()) if lengths.size else 0,
        "mean": float(lengths.mean()) if lengths.size else 0.0,
        "p50": float(q[0]),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "max": int(lengths.max()) if lengths.size else 0,
        "bands": bands,
    }


def _band(label: str, lengths: np.ndarray, mask: np.ndarray, total_tokens: int) -> dict[str, Any]:
    n = int(mask.sum())
    tokens = int(lengths[mask].sum())
    return {
        "range": label,
        "samples": n,
        "sample_share": n / lengths.size if lengths.size else 0.0,
        "token_share": tokens / total_tokens if total_tokens else 0.0,
    }


def dataset_fields(data: DatasetPacking) -> dict[str, Any]:
    """The dataset fields added to the stats dict: manifest facts and one summary per shard."""
    manifest = data.manifest
    merge = int(manifest.get("image_rule", {}).get("merge_size", 2) or 2)
    temporal = int((manifest.get("video_rule") or {}).get("temporal_patch_size", 2) or 2)
    shards = []
    for shard in data.shards:
        tokens = int(shard.sample_lengths.sum())
        bins = int(shard.samples_per_bin.size)
        shards.append(
            {
                "path": shard.path,
                "format": shard.format,
                "bins": bins,
                "samples": int(shard.samples_per_bin.sum()),
                "tokens": tokens,
                "images": int(shard.images_per_bin.sum()),
                "image_tokens": int(shard.image_patches_per_bin.sum()) // (merge * merge),
                "videos": int(shard.videos_per_bin.sum()),
                # frames sampled from the videos (grid t x temporal patch), and their <|video_pad|> tokens
                "video_frames": int(shard.video_steps_per_bin.sum()) * temporal,
                "video_tokens": int(shard.video_patches_per_bin.sum()) // (merge * merge),
                "fill_efficiency": tokens / (bins * data.capacity) if bins else 0.0,
                "bytes": shard.size_bytes,
            }
        )
    return {
        "path": data.url,
        "format": data.format,
        "formats": manifest.get("formats", []),
        "seq_len": data.capacity,
        "tokenizer": (manifest.get("tokenizer") or {}).get("name"),
        "algorithm": manifest.get("algorithm"),
        "counts": manifest.get("counts", {}),
        "image_tokens": sum(s["image_tokens"] for s in shards),
        **{k: sum(s[k] for s in shards) for k in ("videos", "video_frames", "video_tokens")},
        "videos_per_bin": _videos_per_bin(data),
        "bytes": sum(s["bytes"] for s in shards),
        "shards": shards,
        "warnings": list(data.warnings),
    }


def _videos_per_bin(data: DatasetPacking) -> dict[str, float]:
    """Mean and largest number of videos in a bin (zeros for a dataset without videos)."""
    per_bin = [s.videos_per_bin for s in data.shards if s.videos_per_bin.size]
    values = np.concatenate(per_bin) if per_bin else np.zeros(0, np.int64)
    bins = int(data.samples_per_bin.size)
    return {
        "mean": float(values.sum() / bins) if bins else 0.0,
        "max": int(values.max()) if values.size else 0,
    }


def _table(title: str, **kwargs: Any) -> Table:
    # the title is printed as a heading above the table (see _print), so it never wraps to the table's width
    return Table(title=title, box=box.SIMPLE_HEAD, **kwargs)


def _print(console: Console, table: Table) -> None:
    console.print(Text(str(table.title), style="bold"))
    table.title = None
    console.print(table)


def _fmt_int(value: Any) -> str:
    return f"{int(value):,}" if value is not None else "-"


def _fmt_pct(value: Any, digits: int = 3) -> str:
    return f"{100 * float(value):.{digits}f}%" if value is not None else "-"


def _gap(num_bins: int, bound: Any) -> str:
    if bound is None:
        return "-"
    bound = int(bound)
    gap = num_bins - bound
    rel = f"{100 * gap / bound:.4f}%" if bound else "-"
    return f"{bound:,} bins (gap {gap:+,} bins, {rel})"


def _num(value: Any) -> str:
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.2f}"
    return f"{int(value):,}"


def _dist_text(value: Any) -> str:
    if isinstance(value, dict):
        return "  ".join(f"{k} {_num(v)}" for k, v in value.items())
    return str(value)


def summary_table(stats: dict[str, Any], title: str) -> Table:
    """Main metrics: counts, fill efficiency, lower bounds and gaps, padding compression, per-bin counts."""
    table = _table(title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")
    bins = int(stats["num_bins"])
    rows = [
        ("samples packed", _fmt_int(stats.get("num_samples"))),
        ("bins", _fmt_int(bins)),
        ("capacity (tokens per bin)", _fmt_int(stats.get("capacity"))),
        ("tokens", _fmt_int(stats.get("total_tokens"))),
        ("fill efficiency", _fmt_pct(stats.get("fill_efficiency"))),
        ("L1 lower bound", _gap(bins, stats.get("lower_bound_bins"))),
        ("L2 lower bound", _gap(bins, stats.get("l2_lower_bound_bins"))),
        ("padding tokens", _fmt_int(stats.get("padding_tokens"))),
        ("padding compression", _padding_text(stats.get("padding_compression"))),
        ("samples per bin", _dist_text(stats.get("samples_per_bin"))),
        ("images per bin", _dist_text(stats.get("images_per_bin"))),
    ]
    caps_bound = stats.get("source", {}).get("caps_lower_bound_bins")
    if caps_bound is not None:
        rows.insert(7, ("lower bound with caps", _gap(bins, caps_bound)))
    if stats.get("num_rejected"):
        rows.insert(1, ("longer than capacity (not packed)", _fmt_int(stats["num_rejected"])))
    for name, value in rows:
        table.add_row(name, value)
    return table


def _padding_text(ratio: Any) -> str:
    # packing_stats gives None when packing leaves no padding at all
    if ratio is None:
        return "no padding left after packing"
    return f"{float(ratio):,.2f}x less padding than padding every sample to capacity"


def fill_histogram_table(stats: dict[str, Any]) -> Table:
    """Bins per fill band."""
    hist = stats.get("fill_histogram") or {}
    counts = list(hist.values()) if isinstance(hist, dict) else list(hist)
    labels = list(hist.keys()) if isinstance(hist, dict) else list(FILL_BANDS[: len(counts)])
    total = sum(int(c) for c in counts) or 1
    table = _table("Fill histogram (bins by fill)")
    for col in ("fill", "bins", "share"):
        table.add_column(col, justify="right")
    for label, count in zip(labels, counts):
        label = str(label) if str(label).endswith("%") else f"{label}%"
        table.add_row(label, _fmt_int(count), _fmt_pct(int(count) / total, 2))
    return table


def length_table(dist: dict[str, Any]) -> Table:
    """Sample lengths: percentiles in the title, bands of the capacity as rows."""
    title = (
        f"Sample lengths: min {dist['min']:,}  p50 {dist['p50']:,.0f}  mean {dist['mean']:,.1f}  "
        f"p90 {dist['p90']:,.0f}  p99 {dist['p99']:,.0f}  max {dist['max']:,}"
    )
    table = _table(title)
    for col in ("length", "samples", "share", "tokens share"):
        table.add_column(col, justify="right")
    for band in dist["bands"]:
        table.add_row(
            band["range"],
            _fmt_int(band["samples"]),
            _fmt_pct(band["sample_share"], 2),
            _fmt_pct(band["token_share"], 2),
        )
    return table


def shard_table(dataset: dict[str, Any], max_rows: int) -> Table:
    """One row per shard (the first `max_rows`, then a total row)."""
    shards = dataset["shards"]
    table = _table(f"Shards ({dataset['format']}, {len(shards)})")
    for col in ("shard", "bins", "samples", "tokens", "images", "fill", "MB"):
        table.add_column(col, justify="left" if col == "shard" else "right")
    for shard in shards[:max_rows]:
        table.add_row(
            shard["path"],
            _fmt_int(shard["bins"]),
            _fmt_int(shard["samples"]),
            _fmt_int(shard["tokens"]),
            _fmt_int(shard["images"]),
            _fmt_pct(shard["fill_efficiency"], 2),
            f"{shard['bytes'] / 1e6:,.2f}",
        )
    if len(shards) > max_rows:
        table.add_row(f"... {len(shards) - max_rows} more", *[""] * 6)
    bins = sum(s["bins"] for s in shards)
    tokens = sum(s["tokens"] for s in shards)
    fill = tokens / (bins * dataset["seq_len"]) if bins else 0.0
    table.add_row(
        "total",
        _fmt_int(bins),
        _fmt_int(sum(s["samples"] for s in shards)),
        _fmt_int(tokens),
        _fmt_int(sum(s["images"] for s in shards)),
        _fmt_pct(fill, 2),
        f"{dataset['bytes'] / 1e6:,.2f}",
        style="bold",
    )
    return table


def dataset_header(dataset: dict[str, Any]) -> Table:
    """Manifest facts: where, format, tokenizer, algorithm, samples read/rejected."""
    table = _table("Dataset", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    counts = dataset.get("counts", {})
    algo = dataset.get("algorithm") or {}
    rejected = counts.get("rejected_by_reason") or {}
    table.add_row("path", dataset["path"])
    table.add_row("formats", ", ".join(dataset.get("formats", [])) + f" (read: {dataset['format']})")
    table.add_row("tokenizer", str(dataset.get("tokenizer")))
    table.add_row("algorithm", _algorithm_text(algo))
    table.add_row("samples read", _fmt_int(counts.get("samples_read")))
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(rejected.items()))
    table.add_row(
        "samples rejected", _fmt_int(counts.get("samples_rejected")) + (f" ({reasons})" if reasons else "")
    )
    table.add_row("image tokens", _fmt_int(dataset.get("image_tokens")))
    if dataset.get("videos"):
        table.add_row(
            "videos", f"{_fmt_int(dataset['videos'])} ({_dist_text(dataset.get('videos_per_bin'))} per bin)"
        )
        table.add_row("video frames", _fmt_int(dataset.get("video_frames")))
        table.add_row("video tokens", _fmt_int(dataset.get("video_tokens")))
    return table


def _algorithm_text(algo: Any) -> str:
    if not isinstance(algo, dict):
        return str(algo)
    options = {k: v for k, v in algo.items() if k != "name" and v is not None}
    return " ".join([str(algo.get("name", "?")), *(f"{k}={v}" for k, v in options.items())])


def compare_table(rows: list[dict[str, Any]]) -> Table:
    """One row per (algorithm, caps): bins, efficiency, gap to L2 (and to the bound under caps), time."""
    table = _table("Algorithms on the same lengths")
    with_caps = any("caps_lower_bound_bins" in row for row in rows)
    columns = ["algorithm", "max samples/bin", "max images/bin", "bins", "fill", "gap to L2"]
    columns += ["gap to caps bound"] if with_caps else []
    for col in [*columns, "time (ms)"]:
        table.add_column(col, justify="left" if col == "algorithm" else "right")
    for row in rows:
        cells = [row["algorithm"], _cap(row["max_samples_per_bin"]), _cap(row["max_images_per_bin"])]
        if row.get("error"):
            table.add_row(*cells, Text(row["error"], style="red"), *[""] * (len(columns) - 3))
            continue
        cells += [
            _fmt_int(row["num_bins"]),
            _fmt_pct(row["fill_efficiency"]),
            _gap_cell(row["num_bins"], row["l2_lower_bound_bins"]),
        ]
        if with_caps:
            bound = row.get("caps_lower_bound_bins")
            cells.append(_gap_cell(row["num_bins"], bound) if bound is not None else "-")
        cells.append(f"{1000 * row['time_s']:,.1f}" if row.get("time_s") is not None else "-")
        table.add_row(*cells)
    return table


def _gap_cell(bins: int, bound: int) -> str:
    return f"{bins - bound:+,} ({100 * (bins - bound) / bound:.4f}%)" if bound else f"{bins - bound:+,}"


def _cap(value: Any) -> str:
    return "-" if value is None else str(value)


def print_report(console: Console, report: dict[str, Any], max_shard_rows: int = 20) -> None:
    """Print every table of a stats report (the dict that `--json` prints)."""
    source = report.get("source", {})
    dataset = report.get("dataset")
    if dataset:
        _print(console, dataset_header(dataset))
    title = f"Packing of {source.get('path', '?')}"
    if source.get("algorithm"):
        requested = source.get("requested_algorithm")
        chosen = (
            f"{requested} -> {source['algorithm']}"
            if requested not in (None, source["algorithm"])
            else source["algorithm"]
        )
        title += f" (algorithm: {chosen})"
    _print(console, summary_table(report, title))
    _print(console, fill_histogram_table(report))
    if "length_distribution" in report:
        _print(console, length_table(report["length_distribution"]))
    if dataset:
        _print(console, shard_table(dataset, max_shard_rows))
        for warning in dataset.get("warnings", []):
            console.print(Text.assemble(("warning: ", "bold red"), warning))
    if report.get("compare"):
        _print(console, compare_table(report["compare"]))
