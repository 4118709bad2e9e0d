"""Video metadata from the container with PyAV, without decoding a frame: the scan stage's view of a video.

`probe_video` opens the container with a minimal probe (FFmpeg `probesize` 32 bytes, no analysis
duration; retried with FFmpeg's defaults when that leaves the frame size or rate unknown), reads frame
count, frame rate, duration, width and height of the first video stream, and checks the end of the file
by seeking to the last frames and reading up to three packets (compressed data, not decoded), so that a
truncated file is a reject here rather than an error in the loader. It then decodes two frames, the first one
and the one at the last keyframe (`decode_ends`, on by default: about two frames' worth of decoding and reading
per video), so that a file whose frame bytes are damaged (zeroed, overwritten) while its index is intact is an
`undecodable_video` reject rather than a sample the loader drops; `--video-check decode` decodes every planned
frame. The bytes read are counted.

Frame count: the container's (`nb_frames`: mp4/mov sample tables, avi headers), or the frames the decoder
shows where an edit list hides some (`video_timeline`, which also rejects timestamps too coarse to tell
frames apart). Containers without one
(mkv, webm, some mpeg-ts) give round(duration_s * frame_rate) with `frame_count_exact=False`; the loader
then takes frame k as the frame shown at k / frame_rate (as a decoder's approximate seek mode does).
Frame rate: the stream's average rate, else FFmpeg's guessed rate, else frames / duration.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import IO, Any

from mmpack.offline_packing.errors import VideoProbeError
from mmpack.offline_packing.inputs.video_timeline import shown_frames
from mmpack.packing.fileio import NotRegularFileError, open_regular
from mmpack.packing.video_tokens import VideoMeta

# First bytes of the containers FFmpeg reads that PyAV users meet most; a file that starts like one of
# them but does not open is a corrupt video, anything else is not a video.
_SIGNATURES: tuple[tuple[int, bytes], ...] = (
    (4, b"ftyp"),  # mp4, mov, 3gp
    (4, b"moov"),
    (4, b"mdat"),
    (4, b"free"),
    (4, b"wide"),
    (0, b"RIFF"),  # avi (RIFF....AVI )
    (0, b"\x1a\x45\xdf\xa3"),  # matroska, webm (EBML)
    (0, b"FLV"),
    (0, b"\x00\x00\x01\xba"),  # mpeg program stream
    (0, b"OggS"),
)
# Demuxers that read single images or raw streams: FFmpeg opens them, but they are no video container.
_IMAGE_DEMUXERS = ("image2", "_pipe", "gif", "webp", "apng")
_PROBE_OPTIONS = {"probesize": "32", "analyzeduration": "0"}


@dataclass(kw_only=True, frozen=True)
class VideoProbeConfig:
    """Limits of the video probe; a video past one is a reject."""

    max_duration_s: float = 3 * 3600.0
    max_frame_pixels: int = 8192 * 8192
    check_tail: bool = True
    decode_ends: bool = True  # decode the first frame and the last keyframe's (cheap: two frames)

    def __post_init__(self) -> None:
        if not self.max_duration_s > 0:
            raise ValueError(f"max_duration_s must be > 0, got {self.max_duration_s}")
        if self.max_frame_pixels < 1:
            raise ValueError(f"max_frame_pixels must be >= 1, got {self.max_frame_pixels}")


@dataclass(kw_only=True, frozen=True)
class VideoProbe:
    """The metadata of one video and what reading it cost."""

    meta: VideoMeta
    container: str
    codec: str
    size_bytes: int
    bytes_read: int


class _CountingReader(io.RawIOBase):
    """A seekable binary reader that counts the bytes handed to FFmpeg."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self.bytes_read = 0

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._f.read(len(view))  # every binary file object has read(); not all have readinto()
        view[: len(data)] = data
        self.bytes_read += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def probe_video(
    src: str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes],
    config: VideoProbeConfig | None = None,
    *,
    name: str | None = None,
) -> VideoProbe:
    """Metadata of the first video stream; `VideoProbeError` if rejected.

    `src` is a local path, in-memory bytes, or a seekable binary file object (e.g. an fsspec file opened
    for s3:// or http(s)://: only the ranges FFmpeg asks for are read).
    """
    config = config or VideoProbeConfig()
    if isinstance(src, (bytes, bytearray, memoryview)):
        return _probe_file(io.BytesIO(bytes(src)), len(src), name or "<bytes>", config)
    if not isinstance(src, (str, os.PathLike)):
        label = name or str(getattr(src, "path", getattr(src, "name", "<file object>")))
        try:
            size = src.seek(0, os.SEEK_END)
            src.seek(0)
        except OSError as exc:
            raise VideoProbeError("unreadable_video", f"cannot read video {label}: {exc}") from None
        return _probe_file(src, size, label, config)
    path = os.fspath(src)
    name = name or path
    try:
        with open_regular(path) as f:
            return _probe_file(f, os.fstat(f.fileno()).st_size, name, config)
    except FileNotFoundError:
        raise VideoProbeError("missing_video", f"video file {name} does not exist") from None
    except NotRegularFileError as exc:
        raise VideoProbeError("video_not_a_file", f"video {exc}; only regular files are read") from None
    except PermissionError as exc:
        raise VideoProbeError("unreadable_video", f"cannot read video {name}: {exc}") from None


def _probe_file(f: IO[bytes], size: int, name: str, config: VideoProbeConfig) -> VideoProbe:
    if size == 0:
        raise VideoProbeError("empty_video", f"video {name} is an empty file (0 bytes)")
    reader = _CountingReader(f)
    container = _open(reader, f, name, _PROBE_OPTIONS)
    try:
        stream = _video_stream(container, name)
        if not (stream.codec_context.width and stream.average_rate):  # raw streams need a longer probe
            container.close()
            container = _open(reader, f, name, {})
            stream = _video_stream(container, name)
        meta = _metadata(container, stream, name)
        _check_limits(meta, name, config)
        if config.check_tail:
            _check_tail(container, stream, meta, size, name)
        meta = shown_frames(container, stream, meta, name)  # a truncated file is corrupt_video first
        if config.decode_ends:
            _decode_ends(container, stream, meta, name)
        return VideoProbe(
            meta=meta,
            container=str(container.format.name),
            codec=str(stream.codec_context.name),
            size_bytes=size,
            bytes_read=reader.bytes_read,
        )
    finally:
        container.close()


def _open(reader: _CountingReader, f: IO[bytes], name: str, options: dict[str, str]) -> Any:
    import av

    reader.seek(0)
    try:
        return av.open(reader, mode="r", options=options, buffer_size=8192)
    except av.error.FFmpegError as exc:
        f.seek(0)
        head = f.read(16)
        if any(head[at : at + len(sig)] == sig for at, sig in _SIGNATURES):
            raise VideoProbeError(
                "corrupt_video", f"video {name} looks like a video container but cannot be opened: {exc}"
            ) from None
        raise VideoProbeError("not_a_video", f"{name} is not a video file FFmpeg can read: {exc}") from None
    except OSError as exc:
        raise VideoProbeError("unreadable_video", f"cannot read video {name}: {exc}") from None


def _video_stream(container: Any, name: str) -> Any:
    fmt = str(container.format.name)
    if any(tag in fmt for tag in _IMAGE_DEMUXERS) or not container.streams.video:
        what = f"an image ({fmt})" if container.streams.video else f"a {fmt} file without a video stream"
        raise VideoProbeError("not_a_video", f"{name} is {what}, not a video")
    return container.streams.video[0]


def _metadata(container: Any, stream: Any, name: str) -> VideoMeta:
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    if stream.duration:
        duration_s = float(stream.duration * stream.time_base)
    elif container.duration:
        duration_s = container.duration / 1_000_000  # AV_TIME_BASE
    else:
        duration_s = 0.0
    frames = int(stream.frames or 0)
    rate: Fraction | None = stream.average_rate or stream.guessed_rate
    if not rate and frames and duration_s > 0:
        rate = Fraction(frames / duration_s)
    if frames == 0 and duration_s == 0.0:
        raise VideoProbeError("empty_video", f"video {name} has no frames (no frame count, no duration)")
    if not rate or width < 1 or height < 1:
        raise VideoProbeError(
            "corrupt_video",
            f"video {name} has no frame rate or frame size in its container ({width}x{height})",
        )
    fps = float(rate)
    exact = frames > 0
    total = frames if exact else round(duration_s * fps)
    if total == 0:
        raise VideoProbeError(
            "empty_video", f"video {name} has no frames ({duration_s:.3f} s at {fps:.3f} fps)"
        )
    if duration_s == 0.0:
        duration_s = total / fps
    return VideoMeta(
        total_frames=total,
        fps=fps,
        width=width,
        height=height,
        duration_s=duration_s,
        frame_count_exact=exact,
    )


def _check_limits(meta: VideoMeta, name: str, config: VideoProbeConfig) -> None:
    if meta.duration_s > config.max_duration_s:
        raise VideoProbeError(
            "video_too_long",
            f"video {name} lasts {meta.duration_s:.1f} s, above the limit of {config.max_duration_s:.0f} s "
            "(raise the video duration limit or cut the video)",
        )
    if meta.width * meta.height > config.max_frame_pixels:
        raise VideoProbeError(
            "video_too_large",
            f"video {name} has frames of {meta.width}x{meta.height} (w x h), above the limit of "
            f"{config.max_frame_pixels} pixels per frame",
        )


def _check_tail(container: Any, stream: Any, meta: VideoMeta, size: int, name: str) -> None:
    """Seek to the last frames and read up to three packets: a truncated file has none there."""
    import av

    start = stream.start_time or 0
    tail_s = max(0.0, meta.duration_s - 2.0 / meta.fps)
    target = start + int(tail_s / stream.time_base)
    last_end_s: float | None = None
    try:
        container.seek(target, stream=stream, backward=True, any_frame=True)
        for packet, _ in zip(container.demux(stream), range(3)):
            if packet.size == 0 or packet.pts is None:
                continue
            if packet.pos is not None and packet.pos >= 0 and packet.pos + packet.size > size:
                break
            end_s = float((packet.pts - start + (packet.duration or 0)) * stream.time_base)
            last_end_s = end_s if last_end_s is None else max(last_end_s, end_s)  # B-frames: any order
    except av.error.FFmpegError:
        pass
    # a stream's end may lie up to a few frame durations past its last packet (rounding, edit lists)
    slack_s = max(0.5, 4.0 / meta.fps)
    if last_end_s is None or last_end_s < meta.duration_s - slack_s:
        raise VideoProbeError(
            "corrupt_video",
            f"video {name} is truncated: its container announces {meta.duration_s:.2f} s but no packet "
            "was found near that end",
        )


# packets read after a seek before the decoder must have shown a frame (B-frame reordering delays the first by a
# few; a stream that shows none within this many is not one the loader can decode either)
_DECODE_ENDS_MAX_PACKETS = 64


def _decode_ends(container: Any, stream: Any, meta: VideoMeta, name: str) -> None:
    """Decode the first frame, and the frame at the keyframe before the end: VideoProbeError "undecodable_video"
    where either cannot be, as the loader would fail on frames there."""
    import av

    stream.codec_context.thread_count = 1  # two frames: threads would only cost start-up
    start = stream.start_time or 0
    last = start + int(max(0.0, meta.duration_s - 1.0 / meta.fps) / stream.time_base)
    for where, target in (("first frame", start), ("frame at its last keyframe", last)):
        try:
            container.seek(target, stream=stream, backward=True)
            shown = _first_decoded_frame(container, stream)
        except av.error.FFmpegError as exc:
            raise VideoProbeError(
                "undecodable_video",
                f"video {name}: its {where} cannot be decoded: {exc} (damaged frame data?)",
            ) from None
        if not shown:
            raise VideoProbeError(
                "undecodable_video",
                f"video {name}: no {where} comes out of the decoder within {_DECODE_ENDS_MAX_PACKETS} packets "
                "(damaged frame data?)",
            )


def _first_decoded_frame(container: Any, stream: Any) -> bool:
    """Decodes packets from the current position until a frame comes out (True), or none did (False)."""
    for n, packet in enumerate(container.demux(stream)):
        if any(True for _ in packet.decode()):
            return True
        if n >= _DECODE_ENDS_MAX_PACKETS:
            break
    return False
