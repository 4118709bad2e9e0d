"""A video's frames as the decoder will show them, checked at scan time so that a plan never names a frame the
loader cannot find.

Two container oddities make the sample table (`nb_frames`) disagree with what FFmpeg decodes:

- an mp4/mov edit list, as a stream-copy cut (`ffmpeg -ss T -c copy`) writes: the frames from the keyframe
  before the cut up to the cut stay in the file, flagged to be discarded, so the decoder shows fewer frames
  than the table counts. Seen cheaply as a frame count that disagrees with duration x frame rate; such a video
  is then demuxed once (packets only, nothing decoded) and planned over the frames the decoder shows (the
  loader skips the discarded ones too, `mmpack.dataloader.video`): honoured;
- a time base too coarse for the frame rate (an mp4 written with timescale 1): frames share timestamps, so the
  loader cannot tell them apart. Rejected as `video_timestamps`, with how to re-mux it. A time base of a
  second or more (a 1 fps clip at timescale 1) is checked packet by packet and accepted when every frame has
  its own timestamp.

`--video-check decode` goes further: `decode_check` decodes the planned frames of every video at pack time, as
the loader will (`mmpack.dataloader.video.decode_planned_frames`), and rejects a video that fails as
`undecodable_video`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mmpack.offline_packing.errors import VideoProbeError
from mmpack.offline_packing.inputs.remote import is_url
from mmpack.offline_packing.tar_source import is_member_ref, read_image_bytes
from mmpack.packing.video_tokens import VideoMeta


def shown_frames(container: Any, stream: Any, meta: VideoMeta, name: str) -> VideoMeta:
    """`meta` with the frame count the decoder shows; VideoProbeError "video_timestamps" when frames cannot all
    have their own timestamp."""
    tick_s = float(stream.time_base or 0)
    too_coarse = tick_s > 0 and (
        1 / tick_s < meta.fps * (1 - 1e-6)
        or (meta.frame_count_exact and meta.total_frames > meta.duration_s / tick_s + 1)
    )
    if too_coarse:
        raise VideoProbeError("video_timestamps", _coarse_message(name, meta, tick_s))
    expected = meta.duration_s * meta.fps
    slack = max(1.5, 0.01 * meta.total_frames)
    counted = not meta.frame_count_exact or abs(meta.total_frames - expected) <= slack
    # a timescale of 1 (a 1 fps clip) may still give each frame its own second: the packets tell, and only a
    # video whose frames share one is refused
    if counted and tick_s < 1:
        return meta
    container.seek(_EARLIEST, backward=True, any_frame=True)  # from the first packet, pre-roll included
    shown = [p.pts for p in container.demux(stream) if p.size and p.pts is not None and not p.is_discard]
    if len(set(shown)) != len(shown):
        raise VideoProbeError("video_timestamps", _coarse_message(name, meta, tick_s))
    if counted and shown:
        return meta
    if not shown:
        raise VideoProbeError(
            "empty_video", f"video {name} shows no frame (every frame is flagged to be discarded)"
        )
    return dataclasses.replace(meta, total_frames=len(shown))


_EARLIEST = -(1 << 40)  # a seek target (AV_TIME_BASE units) before any stream's first packet


def _coarse_message(name: str, meta: VideoMeta, tick_s: float) -> str:
    scale = f"1/{1 / tick_s:.0f} s" if tick_s else "unknown"
    return (
        f"video {name}: its timestamps (time base {scale}) cannot tell its {meta.total_frames} frames apart at "
        f"{meta.fps:.3f} fps (written with a timescale of 1?); re-mux it with a finer one, e.g. "
        "ffmpeg -i IN -c copy -video_track_timescale 90000 OUT"
    )


def decode_check(remote: Any, path: str, plan: Any, name: str) -> None:
    """Decode the planned frames of the video at `path` (a file, URL or tar member) exactly as the loader will,
    keeping none of them (`remote`: the job's `RemoteFiles`); VideoProbeError "undecodable_video" naming
    `name` if that fails."""
    from mmpack.dataloader.video import VideoDecodeError, decode_planned_frames

    src: str | bytes = read_image_bytes(remote, path) if is_member_ref(path) or is_url(path) else path
    try:
        decode_planned_frames(src, plan, name=name, keep_frames=False)
    except (VideoDecodeError, ValueError, OSError) as exc:
        raise VideoProbeError(
            "undecodable_video", f"{exc} (--video-check decode: the loader would fail on this video)"
        ) from None
