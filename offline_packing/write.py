"""Stage 4, write: the shards (Arrow IPC and/or WebDataset), then rejects.jsonl, stats.json, the Energon
metadata (`--energon`) and, last, manifest.json (the commit point of the dataset).

Reads:  `<work>/binpack/*.npy`, `<work>/lengths/chunk-N.*` (token ids, loss masks, image and video paths,
        video plans), the images and videos (copied as read, never re-encoded).
Writes: `<out>/shards/<prefix>-NNNNNN.{arrow,tar}` (temporary name, then rename), `<work>/write/shard-N.json`
        per finished shard (resume skips those), `<out>/rejects.jsonl`, `<out>/stats.json`,
        `<out>/.nv-meta/` (with --energon), `<out>/manifest.json`; then removes the shards an earlier run
        wrote that the new manifest does not list (`<work>/write/written.json` and the previous manifest
        say which files this job wrote; no other file of the output folder is touched).
Run alone: `python -m mmpack.offline_packing.write <mmpack pack flags>`.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from mmpack.offline_packing.binpack import load_plan
from mmpack.offline_packing.config import WriteConfig, WriteStage
from mmpack.offline_packing.context import JobContext
from mmpack.offline_packing.engines import run_parallel
from mmpack.offline_packing.inputs import codec_assets
from mmpack.offline_packing.inputs.remote import RemoteFiles
from mmpack.offline_packing.outputs.shard_writers import HashingWriter, PackedBin, open_shard_writer
from mmpack.offline_packing.storage import OutputStore
from mmpack.offline_packing.tar_source import read_image_bytes
from mmpack.offline_packing.workdir import WorkDir, read_done_marker
from mmpack.packing.format import MANIFEST_NAME, SHARDS_DIR, bin_key, shard_name
from mmpack.packing.ownership import OwnedFolder
from mmpack.packing.video_codec_ov2 import CODEC_FORMAT

STAGE = "write"


@dataclass(frozen=True)
class ShardTask:
    """One shard to write: bins [first_bin, end_bin) in every configured format (picklable)."""

    shard: int
    first_bin: int
    end_bin: int
    cfg: WriteStage
    fingerprint: str
    with_videos: bool = False  # the dataset holds videos: Arrow shards get the video columns


class BinSource:
    """Builds `PackedBin`s from the stage-2 arrays (memory-mapped) and the image files."""

    MAX_OPEN_CHUNKS = 128  # each chunk's maps hold file descriptors, and a dataset may have thousands

    def __init__(self, wd: WorkDir, remote: RemoteFiles, prefix: str):
        self.wd, self.remote = wd, remote
        self.prefix = prefix
        self._chunks: OrderedDict[int, tuple[np.ndarray, ...]] = OrderedDict()
        accepted = wd.read_marker("lengths")["accepted"]
        self.chunk_starts = np.concatenate([[0], np.cumsum(accepted)]).astype(np.int64)
        self.order = np.load(wd.stage_file("binpack", "order.npy"), mmap_mode="r")
        self.bin_offsets = np.load(wd.stage_file("binpack", "bin_offsets.npy"))

    def chunk(self, c: int) -> tuple[np.ndarray, ...]:
        """Maps of chunk `c`: token ids, loss mask, token offsets, metadata lines and their offsets (the
        `MAX_OPEN_CHUNKS` most recent kept open).

        Nothing is loaded whole, so a worker's memory grows with its shard, not with the dataset.
        """
        if c in self._chunks:
            self._chunks.move_to_end(c)
            return self._chunks[c]
        maps = self._chunks[c] = self._open_chunk(c)
        while len(self._chunks) > self.MAX_OPEN_CHUNKS:
            self._chunks.popitem(last=False)
        return maps

    def _open_chunk(self, c: int) -> tuple[np.ndarray, ...]:
        path = lambda s: self.wd.chunk_path("lengths", c, s)  # noqa: E731
        meta = path("samples.jsonl")
        # asarray: plain ndarray views of the maps (slicing np.memmap objects is slow)
        return (
            np.asarray(np.load(path("ids.npy"), mmap_mode="r")),
            np.asarray(np.load(path("mask.npy"), mmap_mode="r")),
            np.load(path("offsets.npy")),
            np.asarray(np.memmap(meta, dtype=np.uint8, mode="r"))
            if meta.stat().st_size
            else np.zeros(0, np.uint8),
            np.load(path("meta_offsets.npy")),
        )

    def packed_bin(self, b: int) -> PackedBin:
        members = np.asarray(self.order[self.bin_offsets[b] : self.bin_offsets[b + 1]])
        chunks = np.searchsorted(self.chunk_starts, members, side="right") - 1
        samples = []
        for c, g in zip(chunks.tolist(), members.tolist()):
            c_ids, c_mask, c_off, c_meta, c_meta_off = self.chunk(c)
            i = g - int(self.chunk_starts[c])
            lo, hi = int(c_off[i]), int(c_off[i + 1])
            meta = json.loads(c_meta[c_meta_off[i] : c_meta_off[i + 1]].tobytes())
            samples.append((c_ids[lo:hi], c_mask[lo:hi], meta))
        return assemble_bin(bin_key(self.prefix, b), samples, self.remote)


def assemble_bin(
    key: str, samples: list[tuple[np.ndarray, np.ndarray, dict]], remote: RemoteFiles
) -> PackedBin:
    """One bin of its samples' (token ids, loss mask, lengths-stage metadata row), in order: their images and
    videos read as stored (never re-encoded). The offline writer and online packing build bins with it."""
    ids, masks, lens, sample_ids, images, formats, grids = [], [], [], [], [], [], []
    videos, video_formats, video_plans = [], [], []
    for s_ids, s_mask, meta in samples:
        ids.append(s_ids)
        masks.append(s_mask)
        lens.append(len(s_ids))
        sample_ids.append(meta["id"])
        for path, fmt, grid in zip(meta["images"], meta["fmt"], meta["grid"]):
            images.append(read_image_bytes(remote, path))
            formats.append(fmt)
            grids.append(grid)
        codec_files = meta.get("codec_files") or [None] * len(meta.get("videos", ()))
        for path, fmt, plan, files in zip(
            meta.get("videos", ()), meta.get("vfmt", ()), meta.get("video_plans", ()), codec_files
        ):
            if fmt == CODEC_FORMAT and files:  # the training form: canvas files, a positions file, an fps
                videos.append(codec_assets.codec_blob_of_files(**files, name=plan.get("source", path)))
            elif fmt == CODEC_FORMAT:  # a codec folder: its kept canvases and block-ordered positions
                name = plan.get("source", path)
                videos.append(codec_assets.codec_blob(path, name=name, files=codec_assets.AssetFiles(remote)))
            else:
                videos.append(read_image_bytes(remote, path))
            video_formats.append(fmt)
            video_plans.append(plan)
    return PackedBin(
        key=key,
        input_ids=np.concatenate(ids).astype(np.uint32, copy=False),
        loss_mask=np.concatenate(masks).astype(np.uint8, copy=False),
        seq_lens=np.asarray(lens, dtype=np.int32),
        sample_ids=sample_ids,
        images=images,
        image_formats=formats,
        image_grid_thw=np.asarray(grids, dtype=np.int32).reshape(-1, 3),
        videos=videos,
        video_formats=video_formats,
        video_plans=video_plans,
        video_grid_thw=np.asarray([p["grid_thw"] for p in video_plans], dtype=np.int32).reshape(-1, 3),
    )


def write_shard(ctx: JobContext, task: ShardTask) -> list[dict]:
    """Write one shard in every format; returns its manifest entries. Pure function of the task."""
    cfg, options = task.cfg, task.cfg.write
    wd = ctx.work
    store = OutputStore(cfg.output, ctx.storage_options, staging_dir=wd.stage_dir(STAGE))
    done = wd.stage_file(STAGE, f"shard-{task.shard:06d}.json")
    marker = read_done_marker(done, task.fingerprint)
    if marker is not None and all(store.size(e["path"]) == e["bytes"] for e in marker["shards"]):
        return marker["shards"]
    # one per process and job: the write stage runs once per job, after the plan it reads is final
    source = ctx.caches.get(
        "bin_source", options.shard_prefix, lambda: BinSource(wd, ctx.remote, options.shard_prefix)
    )
    rels = [shard_name(options.shard_prefix, task.shard, fmt) for fmt in options.formats]
    samples = tokens = 0
    with ExitStack() as stack:  # every format from one pass over the bins: each bin is built once
        sinks = [HashingWriter(stack.enter_context(store.open_atomic(rel))) for rel in rels]
        writers = [
            open_shard_writer(fmt, sink, task.with_videos)  # type: ignore[arg-type]
            for fmt, sink in zip(options.formats, sinks)
        ]
        for b in range(task.first_bin, task.end_bin):
            packed = source.packed_bin(b)
            for writer in writers:
                writer.add(packed)
            samples += len(packed.seq_lens)
            tokens += len(packed.input_ids)
        for writer in writers:
            writer.close()
    entries = [
        {
            "path": rel,
            "format": fmt,
            "first_bin": task.first_bin,
            "bins": task.end_bin - task.first_bin,
            "samples": samples,
            "tokens": tokens,
            "bytes": sink.size_bytes,
            "sha256": sink.sha256.hexdigest(),
        }
        for rel, fmt, sink in zip(rels, options.formats, sinks)
    ]
    wd.write_json(done, {"fingerprint": task.fingerprint, "shards": entries})
    return entries


def run_write_shards(
    ctx: JobContext, cfg: WriteStage, fingerprint: str, *, workers: int, progress: bool
) -> list[dict]:
    """All shards of the plan, in parallel over shards; returns manifest shard entries (format-major)."""
    wd, options = ctx.work, cfg.write
    plan = load_plan(wd)
    firsts = plan["shard_first_bin"].tolist()
    with_videos = int(wd.read_marker("lengths").get("videos", 0)) > 0
    tasks = [
        ShardTask(s, firsts[s], firsts[s + 1], cfg, fingerprint, with_videos) for s in range(len(firsts) - 1)
    ]
    store = OutputStore(cfg.output, ctx.storage_options)
    store.clean_temporaries(SHARDS_DIR)
    names = [shard_name(options.shard_prefix, t.shard, f) for t in tasks for f in options.formats]
    WriteRecord(wd).add(_written_by(options, names))
    per_shard = run_parallel(
        ctx,
        write_shard,
        tasks,
        workers=workers,
        weights=[t.end_bin - t.first_bin for t in tasks],
        desc="write",
        unit="bins",
        progress=progress,
    )
    return [e for fmt in options.formats for entries in per_shard for e in entries if e["format"] == fmt]


# Only names the writer itself gives shards (`shard_name`, and the `.tar.idx` Energon's preparation puts
# beside a tar) and the files of Energon's metadata folder are ever removed, and only if recorded as written.
_OWN_SHARD = re.compile(rf"^{SHARDS_DIR}/[A-Za-z0-9_-]+-\d{{6}}\.(arrow|tar|tar\.idx)$")
ENERGON_DIR = ".nv-meta"


def _written_by(cfg: WriteConfig, shard_paths: list[str]) -> list[str]:
    """The output paths a write of `shard_paths` creates before its metadata: the shards, and with --energon
    the tar indexes beside them (the `.nv-meta` files are recorded once Energon has written them)."""
    if not cfg.energon:
        return list(shard_paths)
    return [*shard_paths, *(f"{p}.idx" for p in shard_paths if p.endswith(".tar"))]


def _is_energon_file(rel: str) -> bool:
    return rel.startswith(f"{ENERGON_DIR}/")


class WriteRecord:
    """`<work>/write/written.json`: the output files this job has written (shards, and `.nv-meta`)."""

    def __init__(self, wd: WorkDir):
        self.wd = wd
        self.path = wd.stage_file(STAGE, "written.json")

    def read(self) -> set[str]:
        if not self.path.is_file():
            return set()
        with open(self.path, encoding="utf-8") as f:
            return {p for p in json.load(f) if isinstance(p, str)}

    def add(self, paths: list[str]) -> None:
        """Record `paths` as written (before writing them: a killed job's files are known too)."""
        self.wd.write_json(self.path, sorted(self.read() | set(paths)))

    def replace(self, paths: list[str]) -> None:
        self.wd.write_json(self.path, sorted(set(paths)))


def record_previous_dataset(store: OutputStore, wd: WorkDir) -> None:
    """Add the files of the dataset now in the output (its manifest's shards, `.nv-meta`) to the write record,
    before that manifest is removed: they are files an earlier run of mmpack wrote (the caller makes sure
    the output was mmpack's before this run)."""
    if store.size(MANIFEST_NAME) is None:
        return
    try:
        with store.fs.open(store.full_path(MANIFEST_NAME), "rb") as f:
            previous = json.load(f)
        paths = [e["path"] for e in previous["shards"] if isinstance(e.get("path"), str)]
    except (ValueError, KeyError, TypeError, AttributeError):
        return  # not a manifest this job can read: nothing of it is removed
    if store.is_local and store.local_path(ENERGON_DIR).is_dir():
        paths += [*energon_files(store), *(f"{p}.idx" for p in paths if p.endswith(".tar"))]
    WriteRecord(wd).add(paths)


def energon_files(store: OutputStore) -> list[str]:
    """The files now in the output's `.nv-meta` folder (local outputs), as output-relative paths."""
    meta = store.local_path(ENERGON_DIR)
    return sorted(f"{ENERGON_DIR}/{p.relative_to(meta).as_posix()}" for p in meta.rglob("*") if p.is_file())


def remove_unlisted_outputs(
    output: OwnedFolder, wd: WorkDir, cfg: WriteConfig, shards: list[dict]
) -> list[str]:
    """Delete what this job wrote earlier that the new manifest does not list; returns the removed paths.

    Only recorded paths named like the writer's shards (`shards/<prefix>-NNNNNN.arrow|tar`), and recorded
    `.nv-meta` files when the new dataset has no Energon metadata, are candidates, and only in an output
    that carries mmpack's marker (`output`): other files are never touched.
    """
    recorded = WriteRecord(wd).read()
    keep = set(_written_by(cfg, [e["path"] for e in shards]))
    if cfg.energon:
        keep |= {rel for rel in recorded if _is_energon_file(rel)}
    candidates = [
        rel
        for rel in sorted(recorded - keep)
        if _OWN_SHARD.match(rel) or (_is_energon_file(rel) and not cfg.energon)
    ]
    removed = output.remove_recorded(candidates)
    WriteRecord(wd).replace(sorted(keep))
    return removed


if __name__ == "__main__":
    from mmpack.offline_packing.pipeline import stage_main

    raise SystemExit(stage_main(STAGE))
