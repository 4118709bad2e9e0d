"""Container metadata of videos (mmpack.offline_packing.inputs.video_probe): counted from headers or rejected with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmpack.offline_packing.errors import VideoProbeError
from mmpack.offline_packing.inputs.video_probe import VideoProbeConfig, probe_video
from mmpack.packing.video_tokens import VideoRuleError, VideoTokenRule
from tests.support.shared import SHARED_DIR, need_shared
from tests.support.video_fixtures import encode_video

DEMO_VIDEOS = SHARED_DIR / "data" / "mllm_video_demo" / "mllm_demo_data"


def _reject_reason(path: Path | str | bytes, config: VideoProbeConfig | None = None) -> str:
    with pytest.raises(VideoProbeError) as info:
        probe_video(path, config)
    return info.value.reason


@pytest.mark.shared
def test_demo_videos_metadata_without_reading_the_frames() -> None:
    need_shared(DEMO_VIDEOS, what="the video demo")
    expected = {  # SOURCE.md of the demo (read there with PyAV too)
        "1.mp4": (243, 25.0, 640, 360),
        "2.avi": (270, 29.92, 320, 240),
        "3.mp4": (146, 23.976, 640, 360),
    }
    for name, (frames, fps, width, height) in expected.items():
        probe = probe_video(DEMO_VIDEOS / name, VideoProbeConfig(decode_ends=False))  # the header alone
        meta = probe.meta
        assert (meta.total_frames, meta.width, meta.height) == (frames, width, height)
        assert meta.fps == pytest.approx(fps, abs=0.01) and meta.frame_count_exact
        # metadata only: header, index and a packet or two at the end, a small part of the file
        assert probe.bytes_read < 0.2 * probe.size_bytes, (name, probe.bytes_read, probe.size_bytes)


@pytest.mark.parametrize(
    ("n_frames", "codec", "suffix", "fmt"),
    [(11, "libx264", ".mp4", None), (7, "mpeg4", ".avi", None), (13, "libx264", ".mov", None)],
)
def test_odd_frame_counts(tmp_path: Path, n_frames: int, codec: str, suffix: str, fmt: str | None) -> None:
    path = encode_video(tmp_path / f"v{suffix}", n_frames, codec=codec, container_format=fmt)
    meta = probe_video(path).meta
    assert meta.total_frames == n_frames and meta.frame_count_exact
    assert meta.fps == 25.0 and (meta.width, meta.height) == (64, 48)
    plan = VideoTokenRule().plan(meta)
    assert len(plan.frame_indices) % 2 == 0 and plan.frame_indices[-1] <= n_frames - 1


def test_containers_without_frame_count_use_duration_times_rate(tmp_path: Path) -> None:
    for codec, suffix, fmt in [("libvpx", ".webm", "webm"), ("libx264", ".mkv", "matroska")]:
        meta = probe_video(encode_video(tmp_path / f"v{suffix}", 9, codec=codec, container_format=fmt)).meta
        assert not meta.frame_count_exact
        assert meta.total_frames == round(meta.duration_s * meta.fps) == 9


def test_variable_frame_rate(tmp_path: Path) -> None:
    pts = [0, 40, 80, 200, 240, 400, 410, 420, 700, 900, 940]
    mp4 = probe_video(encode_video(tmp_path / "vfr.mp4", len(pts), pts_ms=pts)).meta
    assert mp4.frame_count_exact and mp4.total_frames == len(pts)
    mkv = probe_video(
        encode_video(tmp_path / "vfr.mkv", len(pts), pts_ms=pts, container_format="matroska")
    ).meta
    # no frame count in Matroska: duration x the stream's rate, an estimate for variable frame rates
    assert not mkv.frame_count_exact and mkv.total_frames == round(mkv.duration_s * mkv.fps)


def test_shorter_than_min_frames(tmp_path: Path) -> None:
    rule = VideoTokenRule()
    three = probe_video(encode_video(tmp_path / "three.mp4", 3)).meta
    assert three.total_frames == 3 and len(rule.plan(three).frame_indices) == 2
    one = probe_video(encode_video(tmp_path / "one.mp4", 1)).meta
    with pytest.raises(VideoRuleError) as info:
        rule.plan(one)
    assert info.value.reason == "video_too_short"


def test_truncated_files(tmp_path: Path) -> None:
    faststart = encode_video(tmp_path / "fs.mp4", 30, options={"movflags": "+faststart"})
    index_at_end = encode_video(tmp_path / "end.mp4", 30)
    avi = encode_video(tmp_path / "v.avi", 30, codec="mpeg4")
    mkv = encode_video(tmp_path / "v.mkv", 30, container_format="matroska")
    for path in (faststart, index_at_end, avi, mkv):
        data = path.read_bytes()
        probe_video(data)  # whole: fine
        for keep in (0.5, 0.9):
            cut = tmp_path / f"cut{keep}{path.suffix}"
            cut.write_bytes(data[: int(len(data) * keep)])
            assert _reject_reason(cut) == "corrupt_video", (path.name, keep)


def test_not_a_video_empty_missing(tmp_path: Path) -> None:
    from PIL import Image

    text = tmp_path / "notes.mp4"
    text.write_text("this is not a video\n" * 20)
    png = tmp_path / "picture.mp4"
    Image.new("RGB", (40, 30), (200, 10, 10)).save(png, format="PNG")
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    assert _reject_reason(text) == "not_a_video"
    assert _reject_reason(png) == "not_a_video"
    assert _reject_reason(empty) == "empty_video"
    assert _reject_reason(tmp_path / "absent.mp4") == "missing_video"
    assert _reject_reason(tmp_path) == "video_not_a_file"  # a folder


def test_limits(tmp_path: Path) -> None:
    path = encode_video(tmp_path / "v.mp4", 25, width=320, height=240)
    assert _reject_reason(path, VideoProbeConfig(max_duration_s=0.5)) == "video_too_long"
    assert _reject_reason(path, VideoProbeConfig(max_frame_pixels=320 * 240 - 1)) == "video_too_large"
    assert probe_video(path, VideoProbeConfig(max_frame_pixels=320 * 240)).meta.total_frames == 25


def test_huge_resolution_is_rejected_from_the_header(tmp_path: Path) -> None:
    import av

    # 8208 x 8208 > the default 8192 x 8192 limit; two black frames keep the file small and quick to encode
    path = tmp_path / "huge.mkv"
    with av.open(str(path), "w", format="matroska") as out:
        stream = out.add_stream("libx264", rate=25, options={"preset": "ultrafast"})
        stream.width = stream.height = 8208
        stream.pix_fmt = "yuv420p"
        frame = av.VideoFrame(8208, 8208, "yuv420p")
        for plane in frame.planes:
            plane.update(bytes(plane.buffer_size))
        for packet in [*stream.encode(frame), *stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    assert _reject_reason(path) == "video_too_large"
    assert probe_video(path, VideoProbeConfig(max_frame_pixels=8208 * 8208)).meta.width == 8208


def test_rejects_cross_processes_with_their_reason(tmp_path: Path) -> None:
    import pickle

    from mmpack.packing.errors import MmpackError

    text = tmp_path / "notes.avi"
    text.write_text("no video here")
    with pytest.raises(VideoProbeError) as info:
        probe_video(text)
    copy = pickle.loads(pickle.dumps(info.value))
    assert (
        isinstance(copy, MmpackError) and copy.reason == "not_a_video" and copy.message == info.value.message
    )


def test_every_video_is_planned_or_rejected_with_a_known_reason(tmp_path: Path) -> None:
    """The scan's bookkeeping at this layer: each video read is counted (planned) or rejected, none lost."""
    good = [
        encode_video(tmp_path / "odd.mp4", 11),
        encode_video(tmp_path / "short.avi", 3, codec="mpeg4"),
        encode_video(tmp_path / "vfr.mkv", 5, pts_ms=[0, 10, 400, 410, 990], container_format="matroska"),
    ]
    one_frame = encode_video(tmp_path / "one.mp4", 1)
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(
        encode_video(tmp_path / "whole.mp4", 30, options={"movflags": "+faststart"}).read_bytes()[:900]
    )
    text = tmp_path / "text.webm"
    text.write_text("not a video")
    videos = [*good, one_frame, cut, text, tmp_path / "missing.mov"]
    rule, planned, rejected = VideoTokenRule(), [], {}
    for path in videos:
        try:
            plan = rule.plan(probe_video(path).meta)
        except (VideoProbeError, VideoRuleError) as exc:
            rejected[path.name] = exc.reason
        else:
            planned.append(path.name)
            assert plan.num_tokens > 0
    assert len(planned) + len(rejected) == len(videos)
    assert planned == [p.name for p in good]
    assert rejected == {
        "one.mp4": "video_too_short",
        "cut.mp4": "corrupt_video",
        "text.webm": "not_a_video",
        "missing.mov": "missing_video",
    }


def test_file_objects_read_only_the_ranges_asked_for(tmp_path: Path) -> None:
    import fsspec

    path = encode_video(tmp_path / "v.mp4", 250, width=320, height=240)
    fs = fsspec.filesystem("memory")
    fs.pipe("/videos/v.mp4", path.read_bytes())
    with fs.open("/videos/v.mp4", "rb") as f:
        probe = probe_video(f)
    assert probe.meta == probe_video(path).meta and probe.size_bytes == path.stat().st_size
    assert probe.bytes_read == probe_video(path).bytes_read < probe.size_bytes
