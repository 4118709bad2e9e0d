"""Stage 1, scan: read the raw records, validate them, resolve image paths, read image sizes from headers.

Reads:  the input files (-i) and the images and videos under the image root (-r): image headers, and video
        container metadata (frame count, rate, duration, size; no frame decoded).
Writes: `<work>/scan/chunk-N.samples.jsonl` (normalised conversation, image paths, sizes, formats, bytes;
        video paths, container metadata, formats, bytes),
        `<work>/scan/chunk-N.rejects.jsonl`, `<work>/scan/chunk-N.images.json` (identity of every image file
        read), `<work>/scan/chunk-N.done.json`, then `<work>/scan.done.json`.
Run alone: `python -m mmpack.offline_packing.scan <mmpack pack flags>`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, cast

from mmpack.offline_packing.config import ScanConfig, ScanStage
from mmpack.offline_packing.context import JobContext
from mmpack.offline_packing.engines import run_parallel
from mmpack.offline_packing.errors import PackError, SampleReject, reject_row
from mmpack.offline_packing.fingerprint import FileIdentity, digest, file_identity, identities
from mmpack.offline_packing.inputs import codec_assets
from mmpack.offline_packing.inputs.chunks import Chunk, plan_chunks, read_chunk
from mmpack.offline_packing.inputs.codec_preinfer import CodecPreinfer, default_cache_dir, find_executable
from mmpack.offline_packing.inputs.json_records import RawRecord, lone_surrogate
from mmpack.offline_packing.inputs.remote import InputReadError, RemoteFiles, is_url
from mmpack.offline_packing.inputs.sources import input_folder, resolve_image_path
from mmpack.offline_packing.inputs.video_probe import VideoProbeConfig, probe_video
from mmpack.offline_packing.tar_source import TarSample, is_member_ref, read_image_bytes, resolve_member
from mmpack.offline_packing.workdir import WorkDir, read_done_marker, read_json
from mmpack.packing.chat import Conversation, normalize_record
from mmpack.packing.errors import MmpackError
from mmpack.packing.fileio import NotRegularFileError, open_regular
from mmpack.packing.image_tokens import decode_or_raise, read_image_size
from mmpack.packing.video_codec_ov2 import CODEC_FORMAT, fold_canvas_tags

STAGE = "scan"


@dataclass(frozen=True)
class ScanTask:
    """One chunk of scan work: everything the worker needs, nothing else (picklable)."""

    chunk: Chunk
    cfg: ScanStage
    fingerprint: str


@dataclass(frozen=True)
class ImageCheck:
    """How scan checks an image: full decode or header only, and the largest image allowed (pixels)."""

    full_decode: bool
    max_image_pixels: int
    max_video_seconds: float = 3 * 3600.0
    codec: CodecPreinfer | None = None  # raw videos become LLaVA-OneVision-2 codec assets (--codec-videos)


def codec_preinfer(options: ScanConfig) -> CodecPreinfer | None:
    """How raw videos become codec assets under `options` (None without --codec-videos); PackError in one line
    where cv-preinfer is not found."""
    if not options.codec_videos:
        return None
    try:
        executable = find_executable(options.cv_preinfer)
    except FileNotFoundError as exc:
        raise PackError(f"--codec-videos: {exc}") from None
    return CodecPreinfer(
        executable=executable,
        cache_dir=options.codec_cache or default_cache_dir(),
        target_canvases=options.codec_target_canvases,
        grouping=options.codec_grouping,
    )


def image_check_of(options: ScanConfig) -> ImageCheck:
    """How the scan checks a record's images and videos under `options` (also online packing's,
    `mmpack.offline_packing.online`)."""
    return ImageCheck(
        full_decode=options.image_check == "decode",
        max_image_pixels=options.max_image_pixels,
        max_video_seconds=options.max_video_seconds,
        codec=codec_preinfer(options),
    )


def _read_image(remote: RemoteFiles, path: str, check: ImageCheck) -> tuple[int, int, str, int]:
    """(width, height, format, size_bytes) of an image file; SampleReject if missing, unreadable or too large."""
    full_decode = check.full_decode
    if is_url(path):
        return _read_remote_image(remote, path, check)
    try:
        if is_member_ref(path):  # tar members are small reads from one open file
            data = read_image_bytes(remote, path)
            w, h, fmt = read_image_size(data, check_truncated=True, max_image_pixels=check.max_image_pixels)
            if full_decode:
                _decode_fully(data, path)
            return w, h, fmt, len(data)
        with open_regular(path) as f:  # files: header (and end marker) only
            w, h, fmt = read_image_size(f, check_truncated=True, max_image_pixels=check.max_image_pixels)
            size = os.fstat(f.fileno()).st_size
        if full_decode:
            _decode_fully(read_image_bytes(remote, path), path)
        return w, h, fmt, size
    except FileNotFoundError:
        raise SampleReject("missing_image", f"image file {path} does not exist") from None
    except NotRegularFileError as exc:
        raise SampleReject("image_not_a_file", f"image {exc}; only regular files are read") from None
    except MmpackError as exc:
        raise SampleReject(exc.reason, exc.message) from None
    except (ValueError, OSError) as exc:
        raise SampleReject("unreadable_image", str(exc)) from None


def _read_remote_image(remote: RemoteFiles, url: str, check: ImageCheck) -> tuple[int, int, str, int]:
    """`_read_image` of an image URL: ranged reads of the blocks the header check touches, not the image
    (the whole image only with `--image-check decode`). Network errors past the retries end the job."""
    try:
        f = remote.open_ranged(url)
        header = cast(IO[bytes], f)  # a seekable binary file (io.RawIOBase)
        w, h, fmt = read_image_size(header, check_truncated=True, max_image_pixels=check.max_image_pixels)
        if check.full_decode:
            _decode_fully(remote.read_all(url), url)
        return w, h, fmt, f.size
    except FileNotFoundError:
        raise SampleReject("missing_image", f"image {url} does not exist") from None
    except InputReadError:
        raise
    except MmpackError as exc:
        raise SampleReject(exc.reason, exc.message) from None
    except (ValueError, OSError) as exc:
        raise SampleReject("unreadable_image", str(exc)) from None


def _decode_fully(data: bytes, name: str) -> None:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        decode_or_raise(im, name)


def _read_video(remote: RemoteFiles, path: str, check: ImageCheck) -> dict:
    """Container metadata of a video file, URL or tar member (no frame decoded); SampleReject with the probe's
    reason (missing, unreadable, empty, not a video, corrupt or truncated, too long, frames too large)."""
    config = VideoProbeConfig(max_duration_s=check.max_video_seconds, max_frame_pixels=check.max_image_pixels)
    try:
        if is_member_ref(path):
            probe = probe_video(read_image_bytes(remote, path), config, name=path)
        elif is_url(path):
            probe = probe_video(cast(IO[bytes], remote.open_ranged(path)), config, name=path)
        else:
            probe = probe_video(path, config)
    except FileNotFoundError:
        raise SampleReject("missing_video", f"video {path} does not exist") from None
    except InputReadError:
        raise
    except MmpackError as exc:
        raise SampleReject(exc.reason, exc.message) from None
    except (ValueError, OSError) as exc:
        raise SampleReject("unreadable_video", f"cannot read video {path}: {exc}") from None
    m = probe.meta
    return {
        "meta": {
            "total_frames": m.total_frames,
            "fps": m.fps,
            "width": m.width,
            "height": m.height,
            "duration_s": m.duration_s,
            "frame_count_exact": m.frame_count_exact,
        },
        "nbytes": probe.size_bytes,
    }


def _read_codec_folder(
    remote: RemoteFiles, path: str, name: str, read_files: dict[str, FileIdentity] | None, verify: str
) -> dict:
    """The scan's entry of a codec folder (`codec_assets.read_codec_folder`); SampleReject "codec_video" where
    its assets do not fit. Every file it reads enters the stage fingerprint."""
    assets = codec_assets.AssetFiles(remote)
    try:
        info = codec_assets.read_codec_folder(path, name=name, files=assets)
        files = codec_assets.asset_files(path, assets)
    except MmpackError as exc:
        raise SampleReject(exc.reason, exc.message) from None
    if read_files is not None:
        for f in files:
            read_files.setdefault(f, file_identity(remote, f, verify))
    return {**info, "fmt": CODEC_FORMAT}


def _codec_assets_of(codec: CodecPreinfer, path: str, name: str, probed: dict, rec: RawRecord) -> str:
    """The cached cv-preinfer folder of a local raw video (made if not cached); SampleReject "codec_video"
    where the video is no local file or the preprocessor fails."""
    if rec.tar_sample is not None or is_url(path) or is_member_ref(path):
        raise SampleReject(
            "codec_video",
            f"--codec-videos runs cv-preinfer on local video files only, {name} is not one; make its assets "
            "with cv-preinfer and give the folder in its place",
        )
    try:
        return codec.assets_of(path, int(probed["meta"]["total_frames"]), name=name)
    except MmpackError as exc:
        raise SampleReject(exc.reason, exc.message) from None


def _training_form_row(
    remote: RemoteFiles,
    rec: RawRecord,
    conv: Conversation,
    source: str,
    image_root: str,
    read_files: dict[str, FileIdentity] | None,
    verify: str,
) -> dict:
    """The scan row of a record in LLaVA-OneVision-2's training form of a codec video (its images the canvases
    with one `<image>` each, `patch_positions` one row-major `.npy`, `fps`): the row of the same assets as a
    cv-preinfer folder, its canvases' tags one `<video>`; SampleReject "codec_video" where they do not fit."""
    obj = cast(dict, rec.obj)
    name = conv.sample_id
    given, fps = obj["patch_positions"], obj.get("fps")
    given = given[0] if isinstance(given, list) and len(given) == 1 else given
    fps = fps[0] if isinstance(fps, list) and len(fps) == 1 else fps
    if not isinstance(given, str) or rec.tar_sample is not None:
        raise SampleReject(
            "codec_video",
            f"codec video {name}: patch_positions must name one .npy file of a record outside a tar, got {given!r}",
        )
    canvases = [_locate_image(image, rec, source, image_root) for image in conv.images]
    positions = _locate_image(given, rec, source, image_root)
    if any(is_url(p) for p in (*canvases, positions)):
        raise SampleReject(
            "codec_video", f"codec video {name}: the training form is read from local files only"
        )
    try:
        messages = fold_canvas_tags(conv.messages, len(canvases), name=name)
        info = codec_assets.read_codec_files(canvases, positions, fps, name=name)
    except MmpackError as exc:
        raise SampleReject(exc.reason, exc.message) from None
    if read_files is not None:
        for f in (*canvases, positions):
            read_files.setdefault(f, file_identity(remote, f, verify))
    files = {"canvases": canvases, "positions": positions, "fps": fps}
    return {
        "src": source, "line": rec.line, "id": conv.sample_id, "messages": [list(m) for m in messages],
        "images": [], "wh": [], "fmt": [], "nbytes": [],
        "videos": [positions], "video_info": [{**info, "fmt": CODEC_FORMAT, "files": files}],
        "video_names": [given],
    }  # fmt: skip


def video_format(name: str) -> str:
    """The format name a video is stored under: its file extension, lowercase ("mp4", "avi", ...)."""
    stem, dot, ext = name.rsplit("/", 1)[-1].rpartition(".")
    ext = ext.lower()
    return ext if dot and stem and ext.isascii() and ext.isalnum() and len(ext) <= 8 else "bin"


def _locate_image(image: str, rec: RawRecord, source: str, image_root: str, kind: str = "image") -> str:
    """A file path under the image root, or a member reference for records read from a tar."""
    if isinstance(rec.tar_sample, TarSample):
        try:
            return resolve_member(image, source, rec.tar_sample)
        except FileNotFoundError as exc:
            raise SampleReject(f"missing_{kind}", str(exc)) from None
    try:
        return resolve_image_path(image, image_root)
    except PermissionError as exc:
        raise SampleReject(f"{kind}_path_escape", str(exc)) from None


def scan_record(
    remote: RemoteFiles,
    rec: RawRecord,
    source: str,
    image_root: str,
    check: ImageCheck,
    read_files: dict[str, FileIdentity] | None = None,
    verify: str = "stat",
) -> dict:
    """Validate one raw record and describe it for the lengths stage; SampleReject if it is bad.

    The identity of every image file it reads is added to `read_files` (for the stage fingerprint).
    """
    if rec.error is not None:
        raise SampleReject(rec.error_reason, rec.error)
    if not isinstance(rec.obj, dict):
        raise SampleReject(
            "malformed_record", f"a record must be a JSON object, got {type(rec.obj).__name__}"
        )
    if (bad := lone_surrogate(rec.obj)) is not None:
        raise SampleReject(
            "malformed_record",
            f"{source}:{rec.line}: a string of the record is not valid Unicode ({bad!r}, a lone surrogate from a "
            "\\u escape); fix or remove the record",
        )
    try:
        conv = normalize_record(rec.obj, source=source, line=rec.line)
    except MmpackError as exc:
        raise SampleReject(exc.reason, exc.message) from None
    if "patch_positions" in rec.obj:  # LLaVA-OneVision-2's training form of a codec video
        return _training_form_row(remote, rec, conv, source, image_root, read_files, verify)
    paths, sizes, formats, nbytes = [], [], [], []
    seen: dict[str, tuple[int, int, str, int]] = {}
    for image in conv.images:
        path = _locate_image(image, rec, source, image_root)
        if read_files is not None and path not in read_files and rec.tar_sample is None:
            read_files[path] = file_identity(remote, path, verify)  # before reading: a later edit shows
        if path not in seen:
            seen[path] = _read_image(remote, path, check)
        w, h, fmt, size = seen[path]
        paths.append(path)
        sizes.append([w, h])
        formats.append(fmt)
        nbytes.append(size)
    videos: list[str] = []
    video_info: list[dict] = []
    probed: dict[str, dict] = {}
    for video in conv.videos:
        path = _locate_image(video, rec, source, image_root, kind="video")
        if rec.tar_sample is None and codec_assets.is_codec_folder(path, codec_assets.AssetFiles(remote)):
            if path not in probed:  # LLaVA-OneVision-2 codec canvases: a cv-preinfer folder
                probed[path] = _read_codec_folder(remote, path, video, read_files, verify)
            videos.append(path)
            video_info.append(probed[path])
            continue
        if read_files is not None and path not in read_files and rec.tar_sample is None:
            read_files[path] = file_identity(remote, path, verify)
        if path not in probed:
            probed[path] = _read_video(remote, path, check)
        if check.codec is not None:  # --codec-videos: the raw video's cv-preinfer assets stand in for it
            folder = _codec_assets_of(check.codec, path, video, probed[path], rec)
            if folder not in probed:
                probed[folder] = _read_codec_folder(remote, folder, video, read_files, verify)
            videos.append(folder)
            video_info.append(probed[folder])
            continue
        videos.append(path)
        video_info.append({**probed[path], "fmt": video_format(video)})
    row = {
        "src": source,
        "line": rec.line,
        "id": conv.sample_id,
        "messages": [list(m) for m in conv.messages],
        "images": paths,
        "wh": sizes,
        "fmt": formats,
        "nbytes": nbytes,
    }
    if videos:  # image-only samples keep their earlier form
        row |= {"videos": videos, "video_info": video_info, "video_names": list(conv.videos)}
    return row


def scan_chunk(ctx: JobContext, task: ScanTask) -> dict:
    """Scan one chunk and write its outputs; returns its counts. Pure function of the task and the files."""
    wd = ctx.work
    cfg, options = task.cfg, task.cfg.scan
    done = wd.chunk_path(STAGE, task.chunk.index, "done.json")
    marker = read_done_marker(done, task.fingerprint)
    current = _chunk_images_digest(ctx, task.chunk.index, cfg.verify_inputs)
    if marker is not None and current == marker.get("images"):
        return marker
    chunk = task.chunk
    image_root = options.image_root or input_folder(chunk.path)
    check = ImageCheck(
        full_decode=options.image_check == "decode",
        max_image_pixels=options.max_image_pixels,
        max_video_seconds=options.max_video_seconds,
        codec=codec_preinfer(options),
    )
    rejects: list[dict] = []
    read_files: dict[str, FileIdentity] = {}
    n_read = 0

    def scanned() -> Iterator[dict]:  # written as they come: memory holds one record, not the chunk
        nonlocal n_read
        for rec in read_chunk(ctx, chunk, options.max_record_bytes):
            n_read += 1
            try:
                yield scan_record(
                    ctx.remote, rec, chunk.path, image_root, check, read_files, cfg.verify_inputs
                )
            except SampleReject as exc:
                if cfg.strict:
                    raise PackError(f"{chunk.path}:{rec.line}: {exc.reason}: {exc.message}") from None
                rejects.append(reject_row(chunk.path, rec.line, exc.reason, exc.message, STAGE))

    accepted = wd.write_jsonl(wd.chunk_path(STAGE, chunk.index, "samples.jsonl"), scanned())
    wd.write_jsonl(wd.chunk_path(STAGE, chunk.index, "rejects.jsonl"), rejects)
    images = sorted(read_files.values())
    wd.write_json(wd.chunk_path(STAGE, chunk.index, "images.json"), images)
    counts = {
        "fingerprint": task.fingerprint,
        "read": n_read,
        "accepted": accepted,
        "rejected": len(rejects),
        "images": digest(images),
    }
    wd.write_json(done, counts)
    return counts


def _chunk_images_digest(ctx: JobContext, chunk: int, verify: str) -> str | None:
    """Digest of the current identities of the image files chunk `chunk` read (None: no record of them)."""
    path = ctx.work.chunk_path(STAGE, chunk, "images.json")
    if not path.is_file():
        return None
    return digest(identities(ctx.remote, (row[0] for row in read_json(path)), verify))


def scan_output_fingerprint(ctx: JobContext, fingerprint: str, verify: str) -> str | None:
    """The fingerprint the next stage builds on: the scan's own, plus the current identity of every image it
    read. None unless the scan completed with `fingerprint` and no image it read has changed since."""
    wd: WorkDir = ctx.work
    if not wd.is_done(STAGE, fingerprint):
        return None
    info = wd.read_marker(STAGE)
    current = [_chunk_images_digest(ctx, c["index"], verify) for c in info["chunks"]]
    output = digest(fingerprint, current)
    return output if output == info.get("output_fingerprint") else None


def run_scan(
    ctx: JobContext, cfg: ScanStage, files: list[str], fingerprint: str, *, workers: int, progress: bool
) -> dict:
    """Stage 1 over all chunks of `files` (canonical input paths); returns the marker info."""
    codec_preinfer(cfg.scan)  # a missing cv-preinfer stops the job once, before any chunk
    chunks = plan_chunks(ctx, files, cfg.scan.chunk_size, cfg.scan.max_record_bytes)
    tasks = [ScanTask(c, cfg, fingerprint) for c in chunks]
    results = run_parallel(
        ctx,
        scan_chunk,
        tasks,
        workers=workers,
        weights=[c.count for c in chunks],
        desc="scan",
        progress=progress,
    )
    info = {
        "files": files,
        "chunks": [{"index": c.index, "path": c.path, "count": c.count} for c in chunks],
        "read": sum(r["read"] for r in results),
        "accepted": [r["accepted"] for r in results],
        "rejected": sum(r["rejected"] for r in results),
        "output_fingerprint": digest(fingerprint, [r["images"] for r in results]),
    }
    ctx.work.mark_done(STAGE, fingerprint, info)
    return info


if __name__ == "__main__":
    from mmpack.offline_packing.pipeline import stage_main

    raise SystemExit(stage_main(STAGE))
