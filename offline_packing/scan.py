"""Stage 1, scan: read the raw records, validate them, resolve image paths, read image sizes from headers.

Reads:  the input files (-i) and the images under the image root (-r).
Writes: `<work>/scan/chunk-N.samples.jsonl` (normalised conversation, image paths, sizes, formats, bytes),
        `<work>/scan/chunk-N.rejects.jsonl`, `<work>/scan/chunk-N.done.json`, then `<work>/scan.done.json`.
Run alone: `python -m offline_packing.scan <mmpack pack flags>`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from offline_packing.config import PackJobConfig
from offline_packing.engines.local import run_parallel
from offline_packing.errors import PackError, SampleReject, reason_of, reject_row
from offline_packing.inputs.sources import (
    Chunk,
    RawRecord,
    expand_inputs,
    plan_chunks,
    read_chunk,
    resolve_image_path,
)
from offline_packing.workdir import (
    WorkDir,
    atomic_write_json,
    read_done_marker,
    write_jsonl,
)

STAGE = "scan"


@dataclass(frozen=True)
class ScanTask:
    """One chunk of scan work: everything the worker needs, nothing else (picklable)."""

    chunk: Chunk
    work_dir: str
    image_root: str | None
    full_decode: bool
    strict: bool
    fingerprint: str


def _read_image(path: str, full_decode: bool) -> tuple[int, int, str, int]:
    """(width, height, format, size_bytes) of an image file; SampleReject if missing or unreadable."""
    from offline_packing.tar_source import is_member_ref, read_image_bytes
    from packing.image_tokens import read_image_size

    try:
        # files: header (and end marker) only; tar members are small reads from one open file
        src: str | bytes = read_image_bytes(path) if is_member_ref(path) else path
        w, h, fmt = read_image_size(src, check_truncated=True)
        if full_decode:
            _decode_fully(src if isinstance(src, bytes) else read_image_bytes(path), path)
        size = len(src) if isinstance(src, bytes) else os.path.getsize(path)
        return w, h, fmt, size
    except FileNotFoundError:
        raise SampleReject("missing_image", f"image file {path} does not exist") from None
    except IsADirectoryError:
        raise SampleReject("missing_image", f"image path {path} is a folder") from None
    except (ValueError, OSError) as exc:
        raise SampleReject("unreadable_image", str(exc)) from None


def _decode_fully(data: bytes, name: str) -> None:
    import io

    from PIL import Image

    from packing.image_tokens import decode_or_raise

    with Image.open(io.BytesIO(data)) as im:
        decode_or_raise(im, name)


def _locate_image(image: str, rec: RawRecord, source: str, image_root: str) -> str:
    """A file path under the image root, or a member reference for records read from a tar."""
    from offline_packing.tar_source import TarSample, resolve_member

    if isinstance(rec.tar_sample, TarSample):
        try:
            return resolve_member(image, source, rec.tar_sample)
        except FileNotFoundError as exc:
            raise SampleReject("missing_image", str(exc)) from None
    try:
        return resolve_image_path(image, image_root)
    except PermissionError as exc:
        raise SampleReject("image_path_escape", str(exc)) from None


def scan_record(rec: RawRecord, source: str, image_root: str, full_decode: bool) -> dict:
    """Validate one raw record and describe it for the lengths stage; SampleReject if it is bad."""
    from packing.chat import normalize_record

    if rec.error is not None:
        raise SampleReject(rec.error_reason, rec.error)
    if not isinstance(rec.obj, dict):
        raise SampleReject(
            "malformed_record", f"a record must be a JSON object, got {type(rec.obj).__name__}"
        )
    try:
        conv = normalize_record(rec.obj, source=source, line=rec.line)
    except Exception as exc:
        reason = reason_of(exc)
        if reason is None:
            raise
        raise SampleReject(reason, str(getattr(exc, "message", exc))) from None
    paths, sizes, formats, nbytes = [], [], [], []
    seen: dict[str, tuple[int, int, str, int]] = {}
    for image in conv.images:
        path = _locate_image(image, rec, source, image_root)
        if path not in seen:
            seen[path] = _read_image(path, full_decode)
        w, h, fmt, size = seen[path]
        paths.append(path)
        sizes.append([w, h])
        formats.append(fmt)
        nbytes.append(size)
    return {
        "src": source,
        "line": rec.line,
        "id": conv.sample_id,
        "messages": [list(m) for m in conv.messages],
        "images": paths,
        "wh": sizes,
        "fmt": formats,
        "nbytes": nbytes,
    }


def scan_chunk(task: ScanTask) -> dict:
    """Scan one chunk and write its outputs; returns its counts. Pure function of the task."""
    wd = WorkDir(task.work_dir)
    done = wd.chunk_path(STAGE, task.chunk.index, "done.json")
    if (marker := read_done_marker(done, task.fingerprint)) is not None:
        return marker
    chunk = task.chunk
    image_root = task.image_root or str(Path(chunk.path).parent)
    samples, rejects = [], []
    n_read = 0
    for rec in read_chunk(chunk):
        n_read += 1
        try:
            samples.append(scan_record(rec, chunk.path, image_root, task.full_decode))
        except SampleReject as exc:
            row = reject_row(chunk.path, rec.line, exc.reason, exc.message, STAGE)
            if task.strict:
                raise PackError(f"{chunk.path}:{rec.line}: {exc.reason}: {exc.message}") from None
            rejects.append(row)
    write_jsonl(wd.chunk_path(STAGE, chunk.index, "samples.jsonl"), samples)
    write_jsonl(wd.chunk_path(STAGE, chunk.index, "rejects.jsonl"), rejects)
    counts = {
        "fingerprint": task.fingerprint,
        "read": n_read,
        "accepted": len(samples),
        "rejected": len(rejects),
    }
    atomic_write_json(done, counts)
    return counts


def run_scan(cfg: PackJobConfig, wd: WorkDir) -> dict:
    """Stage 1 over all chunks; returns the marker info (chunks, counts)."""
    files = expand_inputs(cfg.inputs)
    chunks = plan_chunks(files, cfg.chunk_size)
    fingerprint = cfg.stage_fingerprint(1)
    tasks = [
        ScanTask(c, str(wd.root), cfg.image_root, cfg.image_check == "decode", cfg.strict, fingerprint)
        for c in chunks
    ]
    results = run_parallel(
        scan_chunk,
        tasks,
        workers=cfg.workers,
        weights=[c.count for c in chunks],
        desc="scan",
        progress=cfg.progress,
    )
    info = {
        "files": files,
        "chunks": [{"index": c.index, "path": c.path, "count": c.count} for c in chunks],
        "read": sum(r["read"] for r in results),
        "accepted": [r["accepted"] for r in results],
        "rejected": sum(r["rejected"] for r in results),
    }
    wd.mark_done(STAGE, fingerprint, info)
    return info


if __name__ == "__main__":
    from offline_packing.pack_cli import main_for_stage

    raise SystemExit(main_for_stage(1))
