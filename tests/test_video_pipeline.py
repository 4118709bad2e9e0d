"""Videos through the whole offline job and the loader: records -> scan (container metadata) -> lengths (the
qwen-vl-utils rule) -> shards (bytes as read, plans recorded) -> loader (exactly the planned frames)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mmpack.dataloader.collate import CollateConfig, collate_bins
from mmpack.dataloader.manifest import load_manifest
from mmpack.dataloader.readers import ArrowShardReader, WdsShardReader
from mmpack.dataloader.video import resize_frame, video_to_patches
from mmpack.offline_packing.inputs.video_probe import probe_video
from mmpack.offline_packing.options import job_config
from mmpack.offline_packing.pipeline import read_manifest, run_pack
from mmpack.packing.image_tokens import ImageTokenRule
from mmpack.packing.video_tokens import VideoPlan, VideoTokenRule
from tests.support.reference import qwen_vl_video_plan
from tests.support.shared import QWEN3_TOKENIZER, SHARED_DIR, need_import, need_shared
from tests.support.video_fixtures import encode_video, reference_frames

DEMO_DIR = SHARED_DIR / "data" / "mllm_video_demo"
VIDEO_PAD, IMAGE_PAD = 151656, 151655


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _bins(out: Path, fmt: str) -> list[dict]:
    manifest = read_manifest(str(out))
    records = []
    for entry in sorted((e for e in manifest["shards"] if e["format"] == fmt), key=lambda e: e["first_bin"]):
        path = str(out / entry["path"])
        reader = ArrowShardReader(path, label=path) if fmt == "arrow" else WdsShardReader(path, label=path)
        records += [reader.read(i) for i in range(len(reader))]
        reader.close()
    return records


def _collate_config(out: Path) -> CollateConfig:
    manifest = load_manifest(str(out))
    assert manifest.video_pad_id == VIDEO_PAD
    return CollateConfig.from_manifest(manifest)


def _reference_patches(path: Path, plan: VideoPlan) -> np.ndarray:
    """The plan's frames by PyAV's plainest route (decode all, pick), resized and patchified."""
    frames = np.stack([resize_frame(f, plan.resized_hw) for f in reference_frames(path, plan)])
    return video_to_patches(frames, ImageTokenRule())


@pytest.fixture(scope="module")
def demo_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_shared(
        DEMO_DIR / "mllm_video_demo.json", QWEN3_TOKENIZER, what="the video demo, the Qwen3 tokenizer"
    )
    out = tmp_path_factory.mktemp("video_demo") / "out"
    cfg = job_config(
        inputs=(str(DEMO_DIR / "mllm_video_demo.json"),),
        output=str(out),
        seq_len=8192,
        tokenizer=str(QWEN3_TOKENIZER),
        format="both",
        progress=False,
    )
    run_pack(cfg)
    return out


@pytest.mark.shared
def test_demo_records_pack_with_the_rule_token_counts(demo_dataset: Path) -> None:
    manifest = read_manifest(str(demo_dataset))
    counts = manifest["counts"]
    assert (counts["samples_read"], counts["samples_packed"], counts["samples_rejected"]) == (3, 3, 0)
    assert manifest["version"] == 3 and VideoTokenRule.from_dict(manifest["video_rule"]) == VideoTokenRule()
    assert manifest["tokenizer"]["special_ids"]["video_pad"] == VIDEO_PAD
    raw = json.loads((DEMO_DIR / "mllm_video_demo.json").read_text())
    expected = {}  # video file bytes -> the reference rule's tokens, from metadata read here
    for rec in raw:
        path = DEMO_DIR / rec["videos"][0]
        meta = probe_video(path).meta
        ref = qwen_vl_video_plan(meta.total_frames, meta.fps, meta.height, meta.width)
        assert ref is not None
        expected[path.read_bytes()] = (ref["tokens"], ref["indices"], ref["grid"])
    assert sorted(t for t, _, _ in expected.values()) == [1260, 1794, 2691]
    assert counts["video_tokens"] == 1260 + 1794 + 2691 and counts["videos"] == 3
    arrow, wds = _bins(demo_dataset, "arrow"), _bins(demo_dataset, "wds")
    assert len(arrow) == len(wds) and sum(len(b["seq_lens"]) for b in arrow) == 3
    seen = 0
    for a, w in zip(arrow, wds):
        assert a["videos"] == w["videos"] and a["video_plans"] == w["video_plans"]
        np.testing.assert_array_equal(a["input_ids"], w["input_ids"])
        np.testing.assert_array_equal(a["video_grid_thw"], w["video_grid_thw"])
        samples = np.split(a["input_ids"], np.cumsum(a["seq_lens"])[:-1])
        assert len(samples) == len(a["videos"])  # one video per record, in sample order
        for ids, blob, plan, fmt in zip(samples, a["videos"], a["video_plans"], a["video_formats"]):
            tokens, indices, grid = expected[blob]  # the stored video is the file, byte for byte
            assert plan["frame_indices"] == indices and tuple(plan["grid_thw"]) == grid
            assert int((ids == VIDEO_PAD).sum()) == tokens and int((ids == IMAGE_PAD).sum()) == 0
            start = int(np.flatnonzero(ids == VIDEO_PAD)[0])
            assert ids[start - 1] == 151652 and ids[start + tokens] == 151653  # one run, framed
            assert fmt in ("mp4", "avi")
            seen += 1
    assert seen == 3


@pytest.mark.shared
def test_loader_decodes_exactly_the_recorded_frames(demo_dataset: Path) -> None:
    cfg = _collate_config(demo_dataset)
    files = {p.read_bytes(): p for p in (DEMO_DIR / "mllm_demo_data").iterdir()}
    records = _bins(demo_dataset, "arrow")
    batch = collate_bins(records, cfg)
    plans = [VideoPlan.from_dict(p) for r in records for p in r["video_plans"]]
    blobs = [v for r in records for v in r["videos"]]
    assert len(plans) == 3
    rows = [p.grid_thw[0] * p.grid_thw[1] * p.grid_thw[2] for p in plans]
    assert batch.pixel_values_videos.shape == (sum(rows), 3 * 2 * 14 * 14)
    assert batch.pixel_values_videos.dtype == np.float32
    np.testing.assert_array_equal(batch.video_grid_thw, [p.grid_thw for p in plans])
    np.testing.assert_array_equal(
        batch.second_per_grid_ts, np.asarray([p.second_per_grid_t for p in plans], np.float32)
    )
    assert batch.pixel_values.shape == (0, 1176) and batch.image_grid_thw.shape == (0, 3)
    # no label on a video pad; the pads are what the videos need (rows / 4 after the 2 x 2 merge)
    assert not np.isin(batch.labels, [VIDEO_PAD]).any()
    assert int((batch.tokens == VIDEO_PAD).sum()) == sum(rows) // 4
    offset = 0
    for blob, plan, n in zip(blobs, plans, rows):
        ref = _reference_patches(files[blob], plan)
        np.testing.assert_array_equal(batch.pixel_values_videos[offset : offset + n], ref)
        offset += n
    # control: the frames next to the planned ones give other pixels
    earlier = [max(0, i - 1) for i in plans[0].frame_indices]
    shifted = VideoPlan.from_dict(plans[0].to_dict() | {"frame_indices": earlier})
    assert not np.array_equal(
        _reference_patches(files[blobs[0]], shifted), batch.pixel_values_videos[: rows[0]]
    )


def _generated_inputs(root: Path) -> tuple[Path, dict[str, str | None]]:
    """Records over generated videos; name -> expected reject reason (None: packed)."""
    media = root / "media"
    media.mkdir(parents=True)
    encode_video(media / "odd.mp4", 11)
    encode_video(media / "odd.avi", 7, codec="mpeg4", width=96, height=64)
    encode_video(media / "vfr.mp4", 8, pts_ms=[0, 40, 80, 200, 240, 400, 410, 900])
    encode_video(media / "vfr.mkv", 5, pts_ms=[0, 10, 400, 410, 990], container_format="matroska")
    encode_video(media / "short.mp4", 3)  # fewer than min_frames: 2 frames sampled
    encode_video(media / "one.mp4", 1)  # a single frame: too short
    encode_video(media / "big.mp4", 4, width=1920, height=1088)  # frames over the job's pixel limit below
    encode_video(media / "wide.mp4", 4, width=1280, height=720)  # large frames, sized down by the rule
    whole = encode_video(media / "whole.mp4", 30, options={"movflags": "+faststart"}).read_bytes()
    (media / "cut.mp4").write_bytes(whole[: len(whole) // 2])
    (media / "text.mp4").write_text("not a video\n" * 10)
    (media / "empty.mp4").write_bytes(b"")
    from PIL import Image

    Image.new("RGB", (56, 56), (9, 99, 199)).save(media / "still.png")
    expected: dict[str, str | None] = {
        "odd.mp4": None,
        "odd.avi": None,
        "vfr.mp4": None,
        "vfr.mkv": None,
        "short.mp4": None,
        "wide.mp4": None,
        "big.mp4": "video_too_large",
        "one.mp4": "video_too_short",
        "cut.mp4": "corrupt_video",
        "text.mp4": "not_a_video",
        "empty.mp4": "empty_video",
        "absent.mp4": "missing_video",
    }
    lines = []
    for i, name in enumerate(expected):
        turns = [
            {"from": "human", "value": f"<video>What happens in clip {i}?"},
            {"from": "gpt", "value": "Bars move."},
        ]
        lines.append({"id": f"v{i}", "video": f"media/{name}", "conversations": turns})
    # one record mixing an image and two videos (ShareGPT), tags in text order
    lines.append(
        {
            "id": "mixed",
            "messages": [
                {"role": "user", "content": "<video>Then<image>and<video>: compare."},
                {"role": "assistant", "content": "Same bars."},
            ],
            "images": ["media/still.png"],
            "videos": ["media/odd.mp4", "media/short.mp4"],
        }
    )
    lines.append({"id": "escape", "video": "../outside.mp4", "conversations": lines[0]["conversations"]})
    path = root / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path, expected | {"mixed": None, "escape": "video_path_escape"}


@pytest.mark.shared
def test_generated_videos_through_the_job(tmp_path: Path, qwen3_tokenizer_path: Path) -> None:
    data, expected = _generated_inputs(tmp_path)
    out = tmp_path / "out"
    cfg = job_config(
        inputs=(str(data),),
        output=str(out),
        seq_len=4096,
        tokenizer=str(qwen3_tokenizer_path),
        format="both",
        workers=2,
        max_image_pixels=1920 * 1088 - 1,
        progress=False,
    )
    run_pack(cfg)
    manifest = read_manifest(str(out))
    counts = manifest["counts"]
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert counts["samples_read"] == len(expected) == counts["samples_packed"] + counts["samples_rejected"]
    want_rejects = {i + 1: r for i, r in enumerate(expected.values()) if r is not None}
    assert {r["line"]: r["reason"] for r in rejects} == want_rejects
    assert counts["samples_packed"] == sum(r is None for r in expected.values())
    records = _bins(out, "arrow")
    sample_ids = [s for r in records for s in r["sample_ids"]]
    singles = [name for name in expected if name not in ("mixed", "escape")]
    packed_ids = [f"v{i}" for i, name in enumerate(singles) if expected[name] is None]
    assert sorted(sample_ids) == sorted([*packed_ids, "mixed"])
    rule = VideoTokenRule()
    cfg_collate = _collate_config(out)
    media = tmp_path / "media"
    files = {p.read_bytes(): p for p in media.iterdir() if p.is_file()}
    for rec in records:
        batch = collate_bins([rec], cfg_collate)
        offset = 0
        for blob, plan_dict in zip(rec["videos"], rec["video_plans"]):
            plan = VideoPlan.from_dict(plan_dict)
            assert plan == rule.plan(probe_video(files[blob]).meta)  # the recorded plan is the rule's
            n = plan.grid_thw[0] * plan.grid_thw[1] * plan.grid_thw[2]
            ref = _reference_patches(files[blob], plan)
            np.testing.assert_array_equal(batch.pixel_values_videos[offset : offset + n], ref)
            offset += n
        assert offset == batch.pixel_values_videos.shape[0]
        assert int((rec["input_ids"] == VIDEO_PAD).sum()) == sum(p["num_tokens"] for p in rec["video_plans"])
    mixed = next(r for r in records if "mixed" in r["sample_ids"])
    assert len(mixed["images"]) == 1 and len(mixed["videos"]) >= 2
    # a 1280 x 720 video is sized down to the rule's per-frame cap
    wide = VideoTokenRule().plan(probe_video(media / "wide.mp4").meta)
    assert wide.resized_hw[0] * wide.resized_hw[1] <= rule.max_pixels < 1280 * 720


@pytest.mark.shared
def test_video_flags_reach_the_rule_and_the_manifest(tmp_path: Path, qwen3_tokenizer_path: Path) -> None:
    from mmpack.offline_packing.flags import parse_job_args

    media = tmp_path / "media"
    media.mkdir()
    encode_video(media / "v.mp4", 50, width=320, height=240)  # 2 s at 25 fps
    rec = {
        "video": "media/v.mp4",
        "conversations": [{"from": "human", "value": "<video>?"}, {"from": "gpt", "value": "ok"}],
    }
    (tmp_path / "d.jsonl").write_text(json.dumps(rec) + "\n")
    base = ["-i", str(tmp_path / "d.jsonl"), "-L", "4096", "-t", str(qwen3_tokenizer_path), "--no-progress"]
    flags = [
        "--video-fps",
        "4",
        "--video-min-frames",
        "2",
        "--video-max-frames",
        "6",
        "--video-min-pixels",
        "3136",
    ]
    flags += ["--video-max-pixels", "50176", "--video-total-pixels", "1e6"]
    cfg = parse_job_args([*base, *flags, "-o", str(tmp_path / "a")], prog="mmpack pack", description="")
    run_pack(cfg)
    rule = VideoTokenRule(
        fps=4, min_frames=2, max_frames=6, min_pixels=3136, max_pixels=50176, total_pixels=1e6
    )
    manifest = read_manifest(str(tmp_path / "a"))
    assert VideoTokenRule.from_dict(manifest["video_rule"]) == rule
    plan = rule.plan(probe_video(media / "v.mp4").meta)
    assert (
        len(plan.frame_indices) == 6
        and plan.num_tokens < VideoTokenRule().plan(probe_video(media / "v.mp4").meta).num_tokens
    )
    assert manifest["counts"]["video_tokens"] == plan.num_tokens
    # defaults: another token count (the rule is in the lengths fingerprint, so a rerun with new flags recounts)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    run_pack(parse_job_args([*base, "-o", str(tmp_path / "b")], prog="mmpack pack", description=""))
    default_plan = VideoTokenRule().plan(probe_video(media / "v.mp4").meta)
    assert (
        read_manifest(str(tmp_path / "b"))["counts"]["video_tokens"]
        == default_plan.num_tokens
        != plan.num_tokens
    )
    with pytest.raises(SystemExit):
        parse_job_args(
            [*base, "--video-min-frames", "9", "--video-max-frames", "4", "-o", str(tmp_path / "c")],
            prog="x",
            description="",
        )


@pytest.mark.shared
@pytest.mark.parametrize("fmt", ["arrow", "wds"])
def test_stats_report_videos_frames_and_video_tokens(
    demo_dataset: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from mmpack.cli import main as mmpack

    assert mmpack(["stats", str(demo_dataset), "--json", "--format", fmt]) == 0
    dataset = json.loads(capsys.readouterr().out)["dataset"]
    # 1.mp4 and 2.avi: 18 frames (9 temporal patches) each, 3.mp4: 12 frames
    assert (dataset["videos"], dataset["video_frames"], dataset["video_tokens"]) == (
        3,
        48,
        2691 + 1260 + 1794,
    )
    assert dataset["videos_per_bin"] == {"mean": 3.0, "max": 3} and dataset["image_tokens"] == 0
    assert mmpack(["stats", str(demo_dataset), "--format", fmt]) == 0
    table = capsys.readouterr().out
    assert "video frames" in table and "5,745" in table


@pytest.mark.slow
@pytest.mark.shared
def test_loader_workers_yield_the_video_inputs(demo_dataset: Path) -> None:
    """Through worker processes (decode there): the same tensors as collating in this process."""
    import torch

    from mmpack.dataloader import Topology, build_loader

    loader = build_loader(
        str(demo_dataset), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=2, num_epochs=1,
    )  # fmt: skip
    batch = next(iter(loader))
    loader.close()
    expected = collate_bins(_bins(demo_dataset, "arrow")[:1], _collate_config(demo_dataset))
    for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "tokens", "labels"):
        assert isinstance(getattr(batch, key), torch.Tensor)
        np.testing.assert_array_equal(getattr(batch, key).numpy(), getattr(expected, key), err_msg=key)
    assert batch.pixel_values_videos.shape[0] > 0 and batch.pixel_values.shape == (0, 1176)


def test_demo_data_includes_generated_videos(tmp_path: Path) -> None:
    from mmpack.demo.synthetic import make_synthetic_dataset, pack_synthetic, train_tiny_bpe
    from mmpack.demo.videos import add_synthetic_videos

    raw = add_synthetic_videos(make_synthetic_dataset(tmp_path / "raw", n_samples=12, seed=1), 4, seed=1)
    assert len(raw.video_paths) == 4 and raw.counts_by_format["video"] == 5  # 4 clips + 1 mixed record
    tokenizer = train_tiny_bpe(tmp_path / "tok", seed=1, video_pad=True)
    summary = pack_synthetic(raw, tokenizer, tmp_path / "packed", seq_len=2048, format="both")
    manifest = read_manifest(str(tmp_path / "packed"))
    ids = manifest["tokenizer"]["special_ids"]
    assert ids["video_pad"] == ids["image_pad"] + 1  # as in Qwen's vocabulary (the tiny model assumes it)
    assert summary.samples_read == summary.samples_packed == 17 and manifest["counts"]["videos"] == 6
    assert summary.video_tokens == manifest["counts"]["video_tokens"] > 0
    records = _bins(tmp_path / "packed", "wds")
    assert sum(len(r["videos"]) for r in records) == 6


@pytest.mark.shared
def test_videos_under_a_url_input(tmp_path: Path, qwen3_tokenizer_path: Path) -> None:
    """Records and videos behind an fsspec URL: probed by ranged reads, stored byte for byte."""
    import fsspec

    video = encode_video(tmp_path / "v.mp4", 11).read_bytes()
    fs = fsspec.filesystem("memory")
    fs.pipe("/url_videos/media/v.mp4", video)
    turns = [{"from": "human", "value": "<video>?"}, {"from": "gpt", "value": "ok"}]
    lines = [
        {"video": "media/v.mp4", "conversations": turns},
        {"video": "media/absent.mp4", "conversations": turns},
    ]
    fs.pipe("/url_videos/d.jsonl", "".join(json.dumps(r) + "\n" for r in lines).encode())
    out = tmp_path / "out"
    cfg = job_config(
        inputs=("memory://url_videos/d.jsonl",), output=str(out), seq_len=4096, tokenizer=str(qwen3_tokenizer_path),
        progress=False,
    )  # fmt: skip
    summary = run_pack(cfg)
    assert (summary.samples_packed, summary.rejected_by_reason) == (1, {"missing_video": 1})
    (record,) = _bins(out, "arrow")
    assert record["videos"] == [video]
    assert summary.video_tokens == VideoTokenRule().plan(probe_video(video).meta).num_tokens


@pytest.mark.shared
def test_compute_balance_counts_video_patches(demo_dataset: Path) -> None:
    """Bin features for balance="compute" hold each video as t images of h x w patches, in both formats."""
    from mmpack.dataloader.balance import load_bin_features
    from mmpack.dataloader.storage import StorageConfig

    for fmt in ("arrow", "wds"):
        manifest = load_manifest(str(demo_dataset), shard_format=fmt)
        features = load_bin_features(manifest, StorageConfig(root=str(demo_dataset)))
        grids = np.concatenate([r["video_grid_thw"] for r in _bins(demo_dataset, fmt)]).astype(np.float64)
        per_step = grids[:, 1] * grids[:, 2]
        assert features[:, 2].sum() == (grids[:, 0] * per_step).sum() > 0  # no images in this dataset
        assert features[:, 3].sum() == (grids[:, 0] * per_step**2).sum()


def test_energon_reads_the_video_fields(tmp_path: Path) -> None:
    need_import("megatron.energon", extra="energon")
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    from mmpack.demo.synthetic import make_synthetic_dataset, pack_synthetic, train_tiny_bpe
    from mmpack.demo.videos import add_synthetic_videos

    raw = add_synthetic_videos(make_synthetic_dataset(tmp_path / "raw", n_samples=6, seed=2), 3, seed=2)
    tokenizer = train_tiny_bpe(tmp_path / "tok", seed=2, video_pad=True)
    out = tmp_path / "packed"
    pack_synthetic(raw, tokenizer, out, seq_len=2048, format="wds", energon=True, max_bins_per_shard=2)
    expected = {r["key"]: r for r in _bins(out, "wds")}
    ds = get_train_dataset(
        str(out), worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0), batch_size=None,
        shuffle_buffer_size=None, max_samples_per_sequence=None, repeat=False,
    )  # fmt: skip
    seen = 0
    for sample in get_loader(ds):
        ref = expected[sample.__key__]
        assert sample.video_plans == ref["video_plans"] and sample.video_formats == ref["video_formats"]
        assert np.asarray(sample.video_grid_thw).tolist() == ref["video_grid_thw"].tolist()
        assert len(sample.videos) == len(ref["videos"])
        seen += len(sample.videos)
    assert seen == 5  # 3 clips + 2 in the mixed record
