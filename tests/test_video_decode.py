"""The loader's video path (mmpack.dataloader.video): exactly the planned frames, in the layout the model takes."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from mmpack.dataloader.video import (
    VideoDecodeError,
    decode_planned_frames,
    load_video,
    resize_frame,
    video_to_patches,
)
from mmpack.offline_packing.inputs.video_probe import probe_video
from mmpack.packing.image_tokens import CLIP_MEAN, CLIP_STD
from mmpack.packing.video_tokens import VideoPlan, VideoTokenRule
from tests.support.shared import SHARED_DIR, need_shared
from tests.support.video_fixtures import encode_video, reference_frames

DEMO_VIDEOS = SHARED_DIR / "data" / "mllm_video_demo" / "mllm_demo_data"


def _plan(path: Path, rule: VideoTokenRule | None = None) -> VideoPlan:
    return (rule or VideoTokenRule()).plan(probe_video(path).meta)


def _check_against_reference(path: Path, plan: VideoPlan, counters: dict | None = None) -> np.ndarray:
    got = decode_planned_frames(path, plan, counters=counters)
    expected = np.stack([resize_frame(f, plan.resized_hw) for f in reference_frames(path, plan)])
    assert got.shape == (len(plan.frame_indices), *plan.resized_hw, 3)
    np.testing.assert_array_equal(got, expected)
    return got


@pytest.mark.slow
@pytest.mark.shared
def test_demo_videos_decode_exactly_the_recorded_frames() -> None:
    need_shared(DEMO_VIDEOS, what="the video demo")
    for name in ("1.mp4", "2.avi", "3.mp4"):
        path = DEMO_VIDEOS / name
        plan = _plan(path)
        frames = _check_against_reference(path, plan)
        # control: the neighbouring frames are different pictures, so a frame off by one would fail above
        shifted = [min(i + 1, plan.frame_indices[-1]) for i in plan.frame_indices]
        neighbours = reference_frames(path, VideoPlan.from_dict({**plan.to_dict(), "frame_indices": shifted}))
        assert not np.array_equal(frames[1], resize_frame(neighbours[1], plan.resized_hw))
        pixels = load_video(path.read_bytes(), plan, name=name)
        t, gh, gw = plan.grid_thw
        assert pixels.video_grid_thw == plan.grid_thw
        assert pixels.pixel_values_videos.shape == (t * gh * gw, 3 * 2 * 14 * 14)
        assert pixels.pixel_values_videos.dtype == np.float32
        assert pixels.second_per_grid_t == plan.second_per_grid_t
        # tokens the offline count promised = rows after the 2 x 2 merge
        assert pixels.pixel_values_videos.shape[0] // 4 == plan.num_tokens


@pytest.mark.parametrize(
    ("n_frames", "codec", "suffix", "fmt"),
    [(11, "libx264", ".mp4", None), (7, "mpeg4", ".avi", None), (9, "libvpx-vp9", ".webm", "webm")],
)
def test_generated_videos(tmp_path: Path, n_frames: int, codec: str, suffix: str, fmt: str | None) -> None:
    path = encode_video(tmp_path / f"v{suffix}", n_frames, codec=codec, container_format=fmt)
    _check_against_reference(path, _plan(path, VideoTokenRule(fps=25.0)))  # every frame a video has


def test_variable_frame_rate(tmp_path: Path) -> None:
    pts = [0, 40, 80, 200, 240, 400, 410, 420, 700, 900, 940, 1500, 1540]
    for suffix, fmt in ((".mp4", None), (".mkv", "matroska")):
        path = encode_video(tmp_path / f"vfr{suffix}", len(pts), pts_ms=pts, container_format=fmt)
        plan = _plan(path, VideoTokenRule(fps=4.0))
        assert plan.frame_count_exact == (suffix == ".mp4")
        _check_against_reference(path, plan)


def test_seeks_instead_of_decoding_everything(tmp_path: Path) -> None:
    path = encode_video(tmp_path / "long.mp4", 240, gop=12)  # 9.6 s at 25 fps, a keyframe every 12 frames
    plan = _plan(path, VideoTokenRule(fps=0.5, min_frames=4))  # 4 frames: 0, 80, 159, 239
    counters: dict[str, int] = {}
    _check_against_reference(path, plan, counters)
    assert plan.frame_indices == (0, 80, 159, 239)
    assert counters["seeks"] == 4
    assert counters["frames_decoded"] <= 4 * 12 + 8  # at most a group of pictures per frame (+ decoder delay)
    # frames in one group of pictures are decoded on without a new seek
    dense = _plan(path, VideoTokenRule(fps=25.0, max_frames=240))
    counters = {}
    _check_against_reference(path, dense, counters)
    assert counters["seeks"] == 1 and counters["frames_decoded"] == 240


def test_changed_file_is_an_error_naming_the_video(tmp_path: Path) -> None:
    path = encode_video(tmp_path / "v.mp4", 11)
    plan = VideoPlan.from_dict({**_plan(path).to_dict(), "frame_indices": [0, 4, 8, 11]})
    with pytest.raises(VideoDecodeError, match=r"v\.mp4 has 11 frames"):
        decode_planned_frames(path, plan)


def _transformers_video_patchify():
    """`Qwen2VLVideoProcessor.patchify` of the installed transformers, taken from its source.

    The module imports torchvision, which does not load against the CPU torch build here; the method itself
    needs only torch, so it is compiled alone.
    """
    import transformers.models.qwen2_vl as pkg

    source = (Path(pkg.__file__).parent / "video_processing_qwen2_vl.py").read_text()
    cls = next(
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor"
    )
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "patchify")
    namespace: dict = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "patchify", "exec"), namespace)
    return namespace["patchify"]


def _normalised(frames: np.ndarray) -> np.ndarray:
    """transformers' rescale (float64, then float32) and normalisation (float32)."""
    scaled = (frames.astype(np.float64) * (1 / 255)).astype(np.float32)
    return (scaled - np.asarray(CLIP_MEAN, np.float32)) / np.asarray(CLIP_STD, np.float32)


@pytest.mark.parametrize("n_frames", [4, 5])
def test_patch_layout_equals_transformers(n_frames: int) -> None:
    patchify = _transformers_video_patchify()
    rng = np.random.default_rng(n_frames)
    frames = rng.integers(0, 256, size=(n_frames, 56, 84, 3), dtype=np.uint8)
    ours = video_to_patches(frames)
    videos = torch.from_numpy(_normalised(frames)).permute(0, 3, 1, 2)[None]  # [B, T, C, H, W]
    theirs, gt, gh, gw = patchify(None, videos, patch_size=14, merge_size=2, temporal_patch_size=2)
    assert (gt, gh, gw) == ((n_frames + 1) // 2, 4, 6)
    np.testing.assert_array_equal(ours, theirs[0].numpy())
    # control: the order of the two frames of a temporal patch matters
    swapped = frames.copy()
    swapped[[0, 1]] = frames[[1, 0]]
    assert not np.array_equal(video_to_patches(swapped), ours)


def test_still_video_equals_the_image_processor() -> None:
    """Two equal frames give the rows transformers' image processor gives that frame (layout and scaling)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(1)
    frame = rng.integers(0, 256, size=(56, 84, 3), dtype=np.uint8)
    ours = video_to_patches(np.stack([frame, frame]))
    processor = Qwen2VLImageProcessorPil()
    out = processor(images=[frame], do_resize=False, return_tensors="np")
    assert tuple(out["image_grid_thw"][0]) == (1, 4, 6)
    np.testing.assert_array_equal(ours, out["pixel_values"])


def test_resize_is_antialiased_bicubic() -> None:
    rng = np.random.default_rng(2)
    frame = rng.integers(0, 256, size=(90, 160, 3), dtype=np.uint8)
    assert np.array_equal(resize_frame(frame, (90, 160)), frame)  # same size: untouched
    small = resize_frame(frame, (28, 56))
    x = torch.from_numpy(frame).permute(2, 0, 1)[None].float()
    plain = torch.nn.functional.interpolate(x, size=(28, 56), mode="bicubic", align_corners=False)
    plain_u8 = plain.clamp(0, 255).round().to(torch.uint8)[0].permute(1, 2, 0).numpy()
    # control: antialiasing averages the noise away, plain bicubic sampling keeps most of it
    assert small.astype(np.float32).std() < 0.7 * plain_u8.astype(np.float32).std()


def test_collate_videos(tmp_path: Path) -> None:
    from mmpack.dataloader.video import collate_videos

    a = encode_video(tmp_path / "a.mp4", 11)
    b = encode_video(tmp_path / "b.avi", 7, codec="mpeg4", width=96, height=64)
    videos = [load_video(p, _plan(p)) for p in (a, b)]
    batch = collate_videos(videos)
    rows = [v.pixel_values_videos.shape[0] for v in videos]
    assert batch["pixel_values_videos"].shape == (sum(rows), 1176)
    np.testing.assert_array_equal(batch["pixel_values_videos"][rows[0] :], videos[1].pixel_values_videos)
    assert batch["video_grid_thw"].tolist() == [list(v.video_grid_thw) for v in videos]
    assert batch["video_grid_thw"].prod(axis=1).tolist() == rows
    assert batch["second_per_grid_ts"].dtype == np.float32 and batch["second_per_grid_ts"].shape == (2,)
    assert collate_videos([])["video_grid_thw"].shape == (0, 3)


_PEAK_RSS_CHILD = """
import sys
from pathlib import Path
import torch  # loaded up front in both modes (the resize uses it)
from mmpack.dataloader.video import decode_planned_frames
from mmpack.offline_packing.inputs.video_probe import probe_video
from mmpack.packing.video_tokens import VideoTokenRule
from tests.support.video_fixtures import reference_frames

def status_kib(field):  # this process's own memory; ru_maxrss would carry the parent's peak over exec
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])

path = Path(sys.argv[1])
plan = VideoTokenRule(fps=0.5, max_frames=4).plan(probe_video(path).meta)
before = status_kib("VmRSS")
if sys.argv[2] == "planned":
    frames = decode_planned_frames(path, plan)
elif sys.argv[2] == "all":
    frames = reference_frames(path, plan)
print(status_kib("VmHWM") - before)
"""


@pytest.mark.slow
def test_decode_memory_is_bounded(tmp_path: Path) -> None:
    """Frames are resized as they are decoded: peak memory follows the planned frames, not the video's length."""
    import subprocess
    import sys

    rule = VideoTokenRule(fps=0.5, max_frames=4)
    frames = {"short": 150, "long": 450}
    paths = {
        k: encode_video(tmp_path / f"{k}.mp4", n, width=640, height=480, gop=30) for k, n in frames.items()
    }
    assert all(len(_plan(p, rule).frame_indices) == 4 for p in paths.values())
    whole_kib = {k: n * 640 * 480 * 3 // 1024 for k, n in frames.items()}

    def growth(name: str, mode: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", _PEAK_RSS_CHILD, str(paths[name]), mode],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        return int(done.stdout.split()[-1])  # KiB of peak RSS over the RSS before decoding

    seen = {"planned short": growth("short", "planned"), "planned long": growth("long", "planned")}
    seen["all short"] = growth("short", "all")
    # the planned decode's peak is a few frames of working memory (decoder, RGB frame, resize buffers)
    assert seen["planned long"] < whole_kib["long"] // 8, seen
    # three times the video, same four planned frames: the peak stays put (slack for allocator noise)
    assert seen["planned long"] < seen["planned short"] + (whole_kib["long"] - whole_kib["short"]) // 10, seen
    # control: decoding every frame and keeping them (the reference route) grows by about the whole video
    assert seen["all short"] > whole_kib["short"] // 2, seen
