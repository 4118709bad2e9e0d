"""Tiny videos encoded with PyAV for the video tests, and the PyAV reference decode they are checked against."""

from __future__ import annotations

import bisect
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from mmpack.packing.video_tokens import VideoPlan

DEMO_VIDEO_DIR_PARTS = ("data", "mllm_video_demo")


def frame_pattern(i: int, width: int, height: int) -> np.ndarray:
    """A frame that differs from its neighbours (colour ramp + a moving bar), uint8 [h, w, 3]."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.empty((height, width, 3), np.uint8)
    rgb[..., 0] = (x * 255 // max(1, width - 1) + 17 * i) % 256
    rgb[..., 1] = (y * 255 // max(1, height - 1)) % 256
    rgb[..., 2] = np.where(np.abs(x - (5 * i) % width) < 4, 250, 30)
    return rgb


def encode_video(
    path: Path,
    n_frames: int,
    *,
    width: int = 64,
    height: int = 48,
    rate: int = 25,
    codec: str = "libx264",
    container_format: str | None = None,
    pts_ms: list[int] | None = None,
    gop: int | None = None,
    options: dict[str, str] | None = None,
    codec_options: dict[str, str] | None = None,
) -> Path:
    """Encode `n_frames` test frames; `pts_ms` gives variable frame timing (time base 1/1000)."""
    import av

    with av.open(str(path), "w", format=container_format, options=options or {}) as out:
        stream: Any = out.add_stream(codec, rate=rate, options=codec_options or {})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if gop is not None:
            stream.codec_context.gop_size = gop
            if codec == "libx264":
                keyframes_only_every_gop = {"keyint_min": str(gop), "sc_threshold": "0"}
                stream.codec_context.options = {**(codec_options or {}), **keyframes_only_every_gop}
        if pts_ms is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        for i in range(n_frames):
            frame = av.VideoFrame.from_ndarray(frame_pattern(i, width, height), format="rgb24")
            if pts_ms is not None:
                frame.pts, frame.time_base = pts_ms[i], Fraction(1, 1000)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def reference_frames(path: Path | str, plan: VideoPlan) -> list[np.ndarray]:
    """The planned frames by the plainest route: decode every frame in order, then pick (RGB, full size)."""
    import av

    with av.open(str(path)) as container:
        time_base = float(container.streams.video[0].time_base or 0)
        decoded = [(int(f.pts or 0), f.to_ndarray(format="rgb24")) for f in container.decode(video=0)]
    if plan.frame_count_exact:
        return [decoded[i][1] for i in plan.frame_indices]
    pts = [p for p, _ in decoded]
    picked = []
    for i in plan.frame_indices:
        shown_at = pts[0] + round(i / plan.video_fps / time_base)
        picked.append(decoded[max(0, bisect.bisect_right(pts, shown_at) - 1)][1])
    return picked


def stream_copy_cut(src: Path, dst: Path, cut_frames: int, rate: int = 25) -> Path:
    """What `ffmpeg -ss T -c copy` writes: every packet kept, timestamps moved back by `cut_frames` frames, so
    the mp4 muxer writes an edit list and the frames before the cut (from the keyframe before it) stay in the
    file, flagged to be discarded."""
    import av

    with av.open(str(src)) as inp, av.open(str(dst), "w") as out:
        ist = inp.streams.video[0]
        ost = out.add_stream_from_template(ist)
        shift = cut_frames * round(1 / (rate * ist.time_base))
        for packet in inp.demux(ist):
            if packet.dts is None:
                continue
            packet.pts, packet.dts = packet.pts - shift, packet.dts - shift
            packet.stream = ost
            out.mux(packet)
    return dst


def timescale_one(src: Path, dst: Path) -> Path:
    """An mp4 remuxed with a track timescale of 1 (one tick a second): the frames of the first second share
    timestamp 0, and the muxer refuses the first packet that would go back in time, which ends the file."""
    import av

    with av.open(str(src)) as inp, av.open(str(dst), "w", options={"video_track_timescale": "1"}) as out:
        ist = inp.streams.video[0]
        ost = out.add_stream_from_template(ist)
        ost.time_base = Fraction(1, 1)
        for packet in inp.demux(ist):
            if packet.dts is None:
                continue
            packet.stream = ost
            try:
                out.mux(packet)
            except av.error.ArgumentError:  # "Invalid argument": a timestamp going back
                break
    return dst


def zero_frame_packet(src: Path, dst: Path, frame: int) -> Path:
    """A copy of `src` with the coded bytes of one frame zeroed (the `frame`-th in presentation order, found by
    its packet's offset in the file); the index intact. A frame between the first and the last keyframe: the
    scan's two-frame check passes it, decoding every planned frame does not."""
    import av

    with av.open(str(src)) as inp:
        stream = inp.streams.video[0]
        packets = sorted((p.pts, p.pos, p.size) for p in inp.demux(stream) if p.size and p.pts is not None)
    _, pos, size = packets[frame]
    data = bytearray(src.read_bytes())
    data[pos : pos + size] = bytes(size)
    dst.write_bytes(bytes(data))
    return dst
