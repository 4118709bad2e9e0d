"""End of the write stage: rejects.jsonl, stats.json, Energon metadata, then manifest.json (written last).

Everything here is a pure function of the work folder and the config, so reruns give identical bytes.
"""

from __future__ import annotations

import json
from collections import Counter
from importlib import metadata

import numpy as np

from mmpack.offline_packing.binpack import load_plan
from mmpack.offline_packing.config import PackJobConfig
from mmpack.offline_packing.context import JobContext
from mmpack.offline_packing.lengths import load_lengths
from mmpack.offline_packing.outputs.energon_meta import write_energon_metadata
from mmpack.offline_packing.storage import OutputStore
from mmpack.offline_packing.workdir import WorkDir, read_jsonl
from mmpack.packing.fileio import json_bytes
from mmpack.packing.format import MANIFEST_NAME, REJECTS_NAME, STATS_NAME
from mmpack.packing.manifest import Manifest, ManifestCounts, ManifestImageRule, ShardEntry
from mmpack.packing.stats import packing_stats
from mmpack.packing.tokenizer import tokenizer_info


def collect_rejects(wd: WorkDir) -> list[dict]:
    """Every reject of scan and lengths, ordered by input file (argument order) and line."""
    scan = wd.read_marker("scan")
    file_order = {f: i for i, f in enumerate(scan["files"])}
    rows: list[dict] = []
    for stage in ("scan", "lengths"):
        for c in range(len(scan["chunks"])):
            rows += read_jsonl(wd.chunk_path(stage, c, "rejects.jsonl"))
    return sorted(rows, key=lambda r: (file_order.get(r["source"], len(file_order)), r["line"]))


def compute_counts(wd: WorkDir, rejects: list[dict]) -> ManifestCounts:
    """The manifest's "counts": samples read = packed + rejected, always (checked)."""
    scan, lengths, plan = wd.read_marker("scan"), wd.read_marker("lengths"), wd.read_marker("binpack")
    packed = sum(lengths["accepted"])
    counts = ManifestCounts(
        samples_read=scan["read"],
        samples_packed=packed,
        samples_rejected=len(rejects),
        rejected_by_reason=dict(sorted(Counter(r["reason"] for r in rejects).items())),
        bins=plan["bins"],
        tokens=plan["tokens"],
        image_tokens=sum(lengths["image_tokens"]),
        truncated=int(lengths.get("truncated", 0)),
        videos=int(lengths.get("videos", 0)),
        video_tokens=sum(lengths.get("video_tokens", ())),
    )
    if counts.samples_read != packed + len(rejects):
        raise AssertionError(
            f"accounting broken: read {scan['read']} != packed {packed} + rejected {len(rejects)}"
        )
    return counts


def compute_stats(wd: WorkDir, cfg: PackJobConfig, counts: ManifestCounts) -> dict:
    """stats.json: what `mmpack stats --json` reports for the dataset (packing_stats, source, length
    distribution), computed from the job's own lengths and bins, plus the manifest counts."""
    from mmpack.offline_packing.stats.compare import caps_bound_field
    from mmpack.offline_packing.stats.report import length_distribution

    lengths, nimg, _ = load_lengths(wd, len(wd.read_marker("scan")["chunks"]))
    bin_ids = load_plan(wd)["bin_ids"]
    stats = dict(packing_stats(lengths, bin_ids, cfg.seq_len, image_counts=nimg))
    # no "path": the dataset may be copied or moved, and reruns into another folder stay byte-identical
    stats["source"] = {"kind": "dataset", "algorithm": wd.read_marker("binpack")["algorithm"]}
    stats["source"] |= caps_bound_field(
        lengths, cfg.seq_len, nimg, cfg.binpack.max_samples_per_bin, cfg.max_images_per_bin
    )
    if len(lengths):
        stats["length_distribution"] = length_distribution(lengths, cfg.seq_len)
    stats["counts"] = counts.to_dict()
    return json.loads(json.dumps(stats, default=_jsonable))


def _jsonable(x: object) -> object:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def fill_efficiency(stats: dict) -> float:
    value = stats.get("fill_efficiency")
    return float(value) if isinstance(value, (int, float)) else 0.0


def build_manifest(
    ctx: JobContext,
    cfg: PackJobConfig,
    counts: ManifestCounts,
    shards: list[dict],
    algorithm: str | None = None,
) -> Manifest:
    """The manifest of a job's dataset; `algorithm`: the one used, where no binpack marker says it (online
    packing, which describes its rules by the same manifest)."""
    lengths = cfg.lengths
    return Manifest(
        seq_len=cfg.seq_len,
        shards=tuple(ShardEntry.from_dict(e, f"shard {e['path']}") for e in shards),
        formats=tuple(cfg.write.formats),
        tokenizer=tokenizer_info(ctx.tokenizer(cfg.tokenizer, lengths.control_tokens)),
        image_rule=ManifestImageRule.from_rule(lengths.image_rule, cfg.scan.max_image_pixels),
        video_rule=lengths.video_rule,
        chat_template=lengths.chat_template.to_dict(),
        algorithm={
            "name": algorithm or ctx.work.read_marker("binpack")["algorithm"],
            "requested": cfg.binpack.algorithm,
            "max_items_per_bin": cfg.binpack.max_samples_per_bin,
            "max_images_per_bin": cfg.max_images_per_bin,
        },
        seed=cfg.binpack.seed,
        overlength=lengths.overlength,
        counts=counts,
        created_by=f"mmpack {_version()}",
    )


def _version() -> str:
    try:
        return metadata.version("mmpack")
    except metadata.PackageNotFoundError:
        return "unknown"


def finalize(ctx: JobContext, cfg: PackJobConfig, shards: list[dict]) -> Manifest:
    """Write rejects.jsonl, stats.json, .nv-meta (--energon) and manifest.json; returns the manifest."""
    wd = ctx.work
    store = OutputStore(cfg.output, ctx.storage_options, staging_dir=wd.stage_dir("write"))
    rejects = collect_rejects(wd)
    counts = compute_counts(wd, rejects)
    rows = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rejects)
    store.write_bytes(REJECTS_NAME, rows.encode())
    store.write_bytes(STATS_NAME, json_bytes(compute_stats(wd, cfg, counts)))
    if cfg.write.energon:
        if not store.is_local:
            raise ValueError("--energon needs a local output folder (energon prepare indexes local tars)")
        from mmpack.offline_packing.write import WriteRecord, energon_files

        wds = [e for e in shards if e["format"] == "wds"]
        write_energon_metadata(store.local_path(""), wds, cfg.control.workers)
        WriteRecord(wd).add(energon_files(store))  # what Energon wrote there is this job's to remove later
    manifest = build_manifest(ctx, cfg, counts, shards)
    store.write_bytes(MANIFEST_NAME, manifest.to_json())
    return manifest
