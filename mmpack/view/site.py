"""Writes the report folder of a packed dataset: `index.html` (the page, fixed size), `overview.js` (the
`mmpack stats` figures, sources, rejects), `bins/p*.js` (the list of bins, a page per file), `ids/h*.js` (the
sample-id index), `bin/b*.js` and `media/` (the rendered bins), `problems.js` (what could not be shown).

The first page (index, overview, the first page of bins, the first bin) is written before the rest."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mmpack.dataloader.collate import CollateConfig
from mmpack.dataloader.manifest import Manifest
from mmpack.dataloader.readers import open_shard_reader
from mmpack.view.bins import BinContext, bin_view, position_rule_for, renamed
from mmpack.view.listing import IdIndex, id_buckets, script, write_pages
from mmpack.view.page import INDEX_HTML
from mmpack.view.sources import LocalDataset, source_of_bin
from mmpack.view.tokens import TokenDecoder

BIN_NAME = "bin/b{bin:09d}.js"
MARKER = ".mmpack-view"  # in every folder mmpack view writes: only such a folder is written over
_OWN_FOLDERS = ("bin", "bins", "ids", "media")
MAX_REJECTS_SHOWN = 200
MAX_SHARD_ROWS = 50


@dataclass
class ViewOptions:
    """What `mmpack view` writes for one dataset."""

    tokenizer: str | None = None
    bins: int = 20  # the first bins rendered
    extra_bins: tuple[int, ...] = ()
    page_size: int = 100
    positions: str = "auto"
    shard_format: str | None = None
    progress: bool = True
    plot: bool = True
    workers: int = 4
    alias: tuple[tuple[str, str], ...] = ()  # sample-id prefixes shown as another (`BinContext.alias`)
    dataset: LocalDataset | None = None  # a remote dataset's or mixture's local folder (`view.sources`)
    fetch_problems: tuple[str, ...] = ()  # shards that could not be fetched


@dataclass
class ViewReport:
    """What was written, and the timings."""

    out: Path
    bins_rendered: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    first_page_s: float = 0.0
    total_s: float = 0.0
    first_page_bytes: int = 0
    listing_s: float = 0.0  # the rest of the bin list and the sample-id index, after the first page
    stats_s: float = 0.0  # the overview's `mmpack stats` figures and plot, written after the listing


class BinRenderer:
    """Renders bins of one dataset on request (the shard readers stay open)."""

    def __init__(self, root: Path, manifest: Manifest, out: Path, opts: ViewOptions) -> None:
        self.root, self.manifest, self.out = root, manifest, out
        decoder = TokenDecoder(opts.tokenizer, (manifest.raw.get("tokenizer") or {}))
        self.problems = list(decoder.problems)
        self.dataset = opts.dataset
        self.sources = opts.dataset.sources if opts.dataset else ()
        rule = position_rule_for(manifest, opts.positions)
        collate = CollateConfig.from_manifest(manifest, position_rule=rule)
        if self.sources:  # each source's bins decoded by its own image rule, as the loader does
            own = [
                CollateConfig.from_manifest(
                    Manifest.from_dict(json.loads((root / s.folder / "manifest.json").read_text())),
                    position_rule=rule,
                )
                for s in self.sources
            ]
            collate = dataclasses.replace(collate, sources=tuple(own))
        (out / "media").mkdir(parents=True, exist_ok=True)
        self.ctx = BinContext(manifest, collate, decoder, out / "media", alias=opts.alias)
        self._readers: dict[int, Any] = {}

    def render(self, bin_id: int) -> Path | None:
        """Write `bin/b<bin>.js`; None (and a problem line) when its shard cannot be read."""
        if not 0 <= bin_id < self.manifest.num_bins:
            self.problems.append(
                f"bin {bin_id} does not exist: the dataset has {self.manifest.num_bins} bins"
            )
            return None
        index = self.manifest.shard_index(bin_id)
        entry = self.manifest.shards[index]
        path = self.root / entry.path
        try:
            if index not in self._readers:
                self._readers[index] = open_shard_reader(str(path), entry.format, label=str(path))
            rec = self._readers[index].read(bin_id - entry.first_bin)
            k = source_of_bin(self.sources, bin_id)
            shown = self.dataset.shown(str(path)) if self.dataset else str(path)
            view = bin_view(self.ctx, rec, bin_id, shown, source=k if self.sources else None)
            view["source"] = self.sources[k].name if self.sources else ""
        except FileNotFoundError:
            self.problems.append(f"bin {bin_id}: shard {path} is missing")
            return None
        except Exception as e:  # one bad bin: the others still show
            self.problems.append(f"bin {bin_id} ({path}): cannot be shown: {' '.join(str(e).split())}")
            return None
        self.problems += view["problems"]
        target = self.out / BIN_NAME.format(bin=bin_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(script("bin", view), encoding="utf-8")
        return target

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


def prepare_out(out: Path) -> None:
    """Make `out` ready for a report: a new or empty folder, or one mmpack view wrote before (its marker), whose
    bins, pages, id index and images are removed first; any other folder is refused."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; give a folder for the page (-o DIR)")
    names = {p.name for p in out.iterdir()} - {"_packed"} if out.is_dir() else set()
    if names and MARKER not in names:
        raise ValueError(
            f"{out} is not empty and was not written by mmpack view: give a new or empty folder (-o DIR)"
        )
    for name in _OWN_FOLDERS:
        if (out / name).is_dir():
            shutil.rmtree(out / name)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by mmpack view; its next run replaces this folder's report\n")


def write_view(root: Path, out: Path, opts: ViewOptions, say: Callable[[str], None] = print) -> ViewReport:
    """Write the report of the packed dataset at `root` into `out`; returns what was written."""
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    report = ViewReport(out)
    manifest = Manifest.from_dict(
        json.loads((root / "manifest.json").read_text()),
        shard_format=opts.shard_format,
        source=str(root / "manifest.json"),
    )
    renderer = BinRenderer(root, manifest, out, opts)
    problems: list[str] = renderer.problems
    problems += opts.fetch_problems
    total_samples = int((manifest.raw.get("counts") or {}).get("samples_packed") or 0) or sum(
        s.samples for s in manifest.shards
    )
    ids = IdIndex(id_buckets(total_samples), renderer.ctx.rename)
    (out / "index.html").write_text(INDEX_HTML, encoding="utf-8")
    (out / "problems.js").write_text(script("problems", []), encoding="utf-8")
    first = _overview(root, out, manifest, opts, ids.buckets)
    _write_js(out / "overview.js", "overview", first)
    pages = write_pages(out, root, manifest, opts.page_size, ids, problems)
    listed = next(pages)
    wanted = sorted({*range(min(opts.bins, manifest.num_bins)), *opts.extra_bins})
    if wanted and renderer.render(wanted[0]):
        report.bins_rendered.append(wanted[0])
    report.first_page_s = time.perf_counter() - t0
    report.first_page_bytes = sum(
        (out / p).stat().st_size for p in ("index.html", "overview.js", "bins/p000000.js")
    ) + sum((out / BIN_NAME.format(bin=b)).stat().st_size for b in report.bins_rendered)
    t_list = time.perf_counter()
    bar = _bar(opts.progress, manifest.num_bins, "listing bins")
    bar.update(listed)
    for n in pages:
        bar.update(n - listed)
        listed = n
    bar.close()
    ids.write(out)
    report.listing_s = time.perf_counter() - t_list
    for b in _progress(opts.progress, wanted[1:], "rendering bins"):
        if renderer.render(b):
            report.bins_rendered.append(b)
    renderer.close()
    t_stats = time.perf_counter()
    full = _overview(root, out, manifest, opts, ids.buckets, stats=True, problems=problems)
    report.stats_s = time.perf_counter() - t_stats
    full["rendered"] = report.bins_rendered
    _write_js(out / "overview.js", "overview", full)
    if opts.dataset is not None:
        problems[:] = _without_repeats([opts.dataset.shown(line) for line in problems], opts.fetch_problems)
    for line in problems:
        say(f"mmpack view: problem: {line}")
    _write_js(out / "problems.js", "problems", problems)
    report.problems = problems
    report.total_s = time.perf_counter() - t0
    return report


def _overview(
    root: Path, out: Path, manifest: Manifest, opts: ViewOptions, buckets: int, *, stats: bool = False,
    problems: list[str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The overview's data: the manifest's facts, the stats (once the listing is done), the rejects."""
    raw = manifest.raw
    data: dict[str, Any] = {
        "path": opts.dataset.label if opts.dataset else str(root),
        "sources": [s.to_dict() for s in opts.dataset.sources] if opts.dataset else [],  # + "figures" below
        "manifest": {k: raw.get(k) for k in ("version", "seq_len", "formats", "tokenizer", "chat_template",
                                              "image_rule", "video_rule", "algorithm", "counts", "created_by")},
        "format": manifest.shards[0].format if manifest.shards else None,
        "num_bins": manifest.num_bins,
        "num_shards": len(manifest.shards),
        "page_size": opts.page_size,
        "id_buckets": buckets,
        "rendered": list(range(min(opts.bins, manifest.num_bins)))[:1],
        "rejects": _rejects(root, raw, opts.alias),
        "stats": None,
        "plot": None,
    }  # fmt: skip
    for source in data["sources"]:
        source["figures"] = _source_counts(root / source["folder"])
    if stats:
        errors: list[str] = []
        report = _stats(root, opts, errors)
        if errors:  # a shard already named among the problems needs no second line
            data["stats_error"] = errors[0]
            if problems is not None and not any(p.startswith("shard ") for p in problems):
                problems += errors
        if report is not None:
            shards = report.get("dataset", {}).get("shards", [])
            for source in data["sources"]:
                source["figures"] |= _shard_figures(shards, source["folder"], manifest.seq_len)
            report.setdefault("dataset", {})["shards"] = shards[:MAX_SHARD_ROWS]
            lengths, bin_ids = report.pop("_lengths"), report.pop("_bin_ids")
            if opts.plot and _plot(out / "overview.png", lengths, bin_ids, report, str(root)):
                data["plot"] = "overview.png"
            data["stats"] = report
    return data


def _source_counts(folder: Path) -> dict[str, Any]:
    """A mixture source's own counts (its manifest's): samples read and packed, tokens, rejects by reason."""
    try:
        counts = json.loads((folder / "manifest.json").read_text()).get("counts") or {}
    except (OSError, ValueError):
        return {}
    keys = ("samples_read", "samples_packed", "samples_rejected", "tokens", "rejected_by_reason")
    return {k: counts[k] for k in keys if k in counts}


def _shard_figures(shards: list[dict[str, Any]], folder: str, seq_len: int) -> dict[str, Any]:
    """A mixture source's `mmpack stats` figures: its shards' rows (`src<k>/...`) summed, fill of its bins."""
    own = [s for s in shards if str(s.get("path", "")).startswith(folder + "/")]
    total: dict[str, Any] = {
        k: sum(int(s.get(k) or 0) for s in own) for k in ("bins", "samples", "tokens", "images", "videos")
    }
    total["fill_efficiency"] = total["tokens"] / (total["bins"] * seq_len) if total["bins"] else 0.0
    return total


def _without_repeats(problems: list[str], fetch_problems: tuple[str, ...]) -> list[str]:
    """`problems` less the listing's line of a shard whose fetch already failed (one line per shard)."""
    failed = {line.split(" ", 2)[1] for line in fetch_problems}  # "shard URL cannot be fetched: ..."
    return [
        line for line in problems
        if line in fetch_problems or not (line.startswith("shard ") and line.split(" ", 2)[1] in failed)
    ]  # fmt: skip


def _stats(root: Path, opts: ViewOptions, problems: list[str]) -> dict[str, Any] | None:
    """The dict of `mmpack stats --json` (its own code), or None and a problem line."""
    from mmpack.offline_packing.stats.cli import build_report

    args = argparse.Namespace(
        path=str(root), format=opts.shard_format, workers=opts.workers, compare=False, capacity=None,
        max_images_per_bin=None, max_samples_per_bin=None,
    )  # fmt: skip
    try:
        report, lengths, bin_ids = build_report(args, {})
    except Exception as e:
        problems.append(f"stats of {root}: {' '.join(str(e).split())}")
        return None
    report["_lengths"], report["_bin_ids"] = lengths, bin_ids
    return report


def _plot(path: Path, lengths: np.ndarray, bin_ids: np.ndarray, report: dict[str, Any], title: str) -> bool:
    """`mmpack stats --plot`'s figure; False where it cannot be drawn (the numbers are on the page anyway)."""
    from mmpack.offline_packing.stats.plot import plot_packing

    try:
        plot_packing(path, lengths, bin_ids, report, title=title)
    except Exception:
        return False
    return True


def _rejects(root: Path, raw: dict[str, Any], alias: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """Rejects by reason (the manifest's counts) and the first rejects of rejects.jsonl."""
    counts = raw.get("counts") or {}
    first: list[dict[str, Any]] = []
    path = root / "rejects.jsonl"
    if path.is_file():
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if len(first) == MAX_REJECTS_SHOWN:
                    break
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                entry = {k: r.get(k) for k in ("sample_id", "reason", "source", "line", "message", "stage")}
                for k in ("sample_id", "source", "message"):
                    if isinstance(entry[k], str):
                        entry[k] = renamed(entry[k], alias)
                first.append(entry)
    return {
        "by_reason": counts.get("rejected_by_reason") or {},
        "total": int(counts.get("samples_rejected") or 0),
        "first": first,
        "file": "rejects.jsonl",
    }


def _write_js(path: Path, call: str, value: Any) -> None:
    path.write_text(script(call, _plain(value)), encoding="utf-8")


def _plain(value: Any) -> Any:
    """JSON values of numpy scalars and arrays, recursively."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _bar(enabled: bool, total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="bin", disable=not enabled, file=sys.stderr, leave=False)


def _progress(enabled: bool, items: list[int], desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(
        items, desc=desc, unit="bin", disable=not enabled or len(items) < 20, file=sys.stderr, leave=False
    )
