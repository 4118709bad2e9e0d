"""No bad sample stops a training run: a sample whose video or image cannot be decoded in the loader is dropped
from its bin (labels masked, media blank, grids kept), named in the log and in `bad_samples-rank<R>.jsonl`,
counted in the log line and the metrics, and trains exactly like its bin with the sample's labels masked;
`--strict-data` stops instead, in one line naming the sample and the file. The offline scan rejects a video whose
frame bytes are zeroed (it decodes the first frame and the last keyframe's), which it passed before."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from mmpack.dataloader.collate import BadSampleError, CollateConfig, collate_bins
from mmpack.dataloader.manifest import load_manifest
from mmpack.dataloader.readers import ArrowShardReader
from mmpack.offline_packing.errors import VideoProbeError
from mmpack.offline_packing.inputs.video_probe import VideoProbeConfig, probe_video
from mmpack.packing.batch import contract_problems
from mmpack.packing.layout import IGNORE_INDEX
from tests.support.bad_samples import (
    BAD_SAMPLE,
    OV2_OPTIONS,
    codec_bin,
    codec_grid,
    damage_video,
    mask_labels,
    pack_video_dataset,
    rewrite_sample,
    sample_span,
    zero_frame_bytes,
)
from tests.support.video_fixtures import encode_video


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The packed dataset (`good`), a copy whose BAD_SAMPLE's video has its frame bytes zeroed inside the shard
    (`damaged`: as a file damaged in a way the scan does not see) and a copy with that sample's labels masked
    (`masked`: what the damaged one must train like)."""
    root = tmp_path_factory.mktemp("bad-samples")
    good = pack_video_dataset(root)
    damaged = root / "damaged"
    rewrite_sample(good, damaged, BAD_SAMPLE, damage_video)
    masked = root / "masked"
    rewrite_sample(good, masked, BAD_SAMPLE, mask_labels)
    return {"good": good, "damaged": damaged, "masked": masked}


def _bin_of(dataset: Path, sample_id: str, **config: object) -> tuple[dict, object]:
    """The record of the bin holding `sample_id` and its collated micro-batch (one bin)."""
    manifest = load_manifest(str(dataset))
    cfg = dataclasses.replace(CollateConfig.from_manifest(manifest), **config)  # type: ignore[arg-type]
    for shard in manifest.shards:
        reader = ArrowShardReader(str(dataset / shard.path), label=shard.path)
        records = [reader.read(i) for i in range(len(reader))]
        reader.close()
        for rec in records:
            if sample_id in rec["sample_ids"]:
                return rec, collate_bins([rec], cfg)
    raise AssertionError(f"no bin holds {sample_id}")


def test_a_video_that_does_not_decode_drops_its_sample_from_the_bin(datasets: dict[str, Path]) -> None:
    rec, dropped = _bin_of(datasets["damaged"], BAD_SAMPLE)
    _, masked = _bin_of(datasets["masked"], BAD_SAMPLE)
    _, good = _bin_of(datasets["good"], BAD_SAMPLE)
    [d] = dropped.dropped  # type: ignore[attr-defined]
    assert contract_problems(dropped) == []  # type: ignore[arg-type]
    assert (d.sample_id, d.bin_key, d.row, d.media) == (BAD_SAMPLE, rec["key"], 0, "videos/clip_0000.mp4")
    assert "cannot decode" in d.error or "ended before" in d.error or "no frame" in d.error, d.error
    assert masked.dropped == good.dropped == ()  # type: ignore[attr-defined]
    # the bin's layout is the masked bin's: tokens, labels, positions, grids; the media of the others unchanged
    for name in (
        "tokens",
        "labels",
        "loss_mask",
        "position_ids",
        "cu_seqlens",
        "video_grid_thw",
        "image_grid_thw",
    ):
        np.testing.assert_array_equal(getattr(dropped, name), getattr(masked, name), err_msg=name)
    np.testing.assert_array_equal(dropped.pixel_values, masked.pixel_values)  # type: ignore[attr-defined]
    k = rec["sample_ids"].index(BAD_SAMPLE)
    start, end = sample_span(rec, k)
    assert (dropped.labels[0, start:end] == IGNORE_INDEX).all()  # type: ignore[attr-defined]
    # its video's rows are blank, every other video's are as decoded
    plans = rec["video_plans"]  # as the reader gives them: dicts
    rows = [int(np.prod(p["grid_thw"])) for p in plans]
    bad = [p.get("sample_id") == BAD_SAMPLE for p in plans]
    at = np.cumsum([0, *rows])
    videos = dropped.pixel_values_videos  # type: ignore[attr-defined]
    for i, is_bad in enumerate(bad):
        part, want = videos[at[i] : at[i + 1]], good.pixel_values_videos[at[i] : at[i + 1]]  # type: ignore[attr-defined]
        np.testing.assert_array_equal(part, np.zeros_like(want) if is_bad else want)
    assert any(bad) and not all(bad)
    # control: the good bin trains on that sample (its labels are not masked), so masking is what makes them equal
    assert (good.labels[0, start:end] != IGNORE_INDEX).any()  # type: ignore[attr-defined]
    assert not np.array_equal(good.labels, dropped.labels)  # type: ignore[attr-defined]


def test_strict_data_stops_at_the_sample_in_one_line(datasets: dict[str, Path]) -> None:
    with pytest.raises(BadSampleError) as info:
        _bin_of(datasets["damaged"], BAD_SAMPLE, strict_data=True)
    message = str(info.value)
    assert "\n" not in message
    assert (
        message.startswith(f"sample '{BAD_SAMPLE}' (bin ")
        and "videos/clip_0000.mp4 cannot be decoded" in message
    )
    _bin_of(datasets["good"], BAD_SAMPLE, strict_data=True)  # control: a good bin passes the strict loader


def test_an_image_that_does_not_decode_drops_its_sample(datasets: dict[str, Path], tmp_path: Path) -> None:
    """The same for an image: its sample (the one whose segment holds the image's pads) is dropped."""
    manifest = load_manifest(str(datasets["good"]))
    reader = ArrowShardReader(str(datasets["good"] / manifest.shards[0].path), label="shard")
    rec = next(r for r in (reader.read(i) for i in range(len(reader))) if len(r["images"]))
    reader.close()
    pads = np.flatnonzero(np.asarray(rec["input_ids"]) == manifest.image_pad_id)
    owner = int(np.searchsorted(np.cumsum(rec["seq_lens"]), pads[0], side="right"))
    sid = rec["sample_ids"][owner]

    def damage_image(row: dict, k: int) -> None:
        row["images"][0] = bytes(len(row["images"][0]))

    rewrite_sample(datasets["good"], tmp_path / "damaged", sid, damage_image)
    bad_rec, batch = _bin_of(tmp_path / "damaged", sid)
    [d] = batch.dropped  # type: ignore[attr-defined]
    assert (d.sample_id, d.media) == (sid, f"image 0 of bin {bad_rec['key']}")
    start, end = sample_span(bad_rec, owner)
    assert (batch.labels[0, start:end] == IGNORE_INDEX).all()  # type: ignore[attr-defined]
    rows = int(np.prod(bad_rec["image_grid_thw"][0]))
    assert not batch.pixel_values[:rows].any()  # type: ignore[attr-defined]
    _, good = _bin_of(datasets["good"], sid)
    assert good.pixel_values[:rows].any() and (good.labels[0, start:end] != IGNORE_INDEX).any()  # type: ignore[attr-defined]


OV2_SAMPLE = "video-1"  # a clip sharing its bin with image samples under LLaVA-OneVision-2's rule


@pytest.fixture(scope="module")
def ov2_datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same records packed under LLaVA-OneVision-2's video rule (each frame an image in token order): the
    packed dataset (`good`), a copy with OV2_SAMPLE's video bytes zeroed (`damaged`) and one with its labels
    masked (`masked`)."""
    root = tmp_path_factory.mktemp("bad-samples-ov2")
    good = pack_video_dataset(root, **OV2_OPTIONS)
    rewrite_sample(good, root / "damaged", OV2_SAMPLE, damage_video)
    rewrite_sample(good, root / "masked", OV2_SAMPLE, mask_labels)
    return {"good": good, "damaged": root / "damaged", "masked": root / "masked"}


def _assert_dropped_like_masked(dropped: object, masked: object, good: object, video_rows: int) -> None:
    """The dropped bin is laid out as the masked one, its video's patch rows (frames or canvases, in
    `pixel_values`) blank and every image's as decoded; control: the good bin trains on the sample."""
    for name in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "image_grid_thw"):
        np.testing.assert_array_equal(getattr(dropped, name), getattr(masked, name), err_msg=name)
    pixels, good_pixels = dropped.pixel_values, good.pixel_values  # type: ignore[attr-defined]
    changed = ~np.all(pixels == good_pixels, axis=1)
    assert int(changed.sum()) == video_rows and not pixels[changed].any()
    assert len(pixels) > video_rows  # the bin's images are there, as decoded
    assert not np.array_equal(good.labels, dropped.labels)  # type: ignore[attr-defined]


def test_a_frames_as_images_video_that_does_not_decode_drops_its_sample(
    ov2_datasets: dict[str, Path],
) -> None:
    """LLaVA-OneVision-2: the frames of a video that does not decode are blank images, and its sample dropped."""
    rec, dropped = _bin_of(ov2_datasets["damaged"], OV2_SAMPLE)
    _, masked = _bin_of(ov2_datasets["masked"], OV2_SAMPLE)
    _, good = _bin_of(ov2_datasets["good"], OV2_SAMPLE)
    assert len(rec["images"]) and len(rec["videos"]) == 1  # a bin of images and one video
    [d] = dropped.dropped  # type: ignore[attr-defined]
    assert (d.sample_id, d.bin_key) == (OV2_SAMPLE, rec["key"]) and d.media.endswith(".mp4"), d
    assert masked.dropped == good.dropped == ()  # type: ignore[attr-defined]
    assert contract_problems(dropped) == []  # type: ignore[arg-type]
    _assert_dropped_like_masked(dropped, masked, good, int(np.prod(rec["video_plans"][0]["grid_thw"])))
    with pytest.raises(BadSampleError, match=f"^sample '{OV2_SAMPLE}' "):
        _bin_of(ov2_datasets["damaged"], OV2_SAMPLE, strict_data=True)


def test_a_codec_video_that_does_not_decode_drops_its_sample(ov2_datasets: dict[str, Path]) -> None:
    """LLaVA-OneVision-2's codec stream: a blob that does not read is one blank grid row of canvases, and its
    sample dropped. The bin is the frames-as-images one with its video stored as a codec blob of one canvas
    per frame (a run of pads each, as a codec video's runs are)."""
    rec, _ = _bin_of(ov2_datasets["good"], OV2_SAMPLE)
    manifest = load_manifest(str(ov2_datasets["good"]))
    cfg = CollateConfig.from_manifest(manifest)
    codec = codec_bin(rec, cfg.rule)
    good = collate_bins([codec], cfg)
    broken = {**codec, "videos": [codec["videos"][0][:100]]}  # a truncated blob
    k = list(rec["sample_ids"]).index(OV2_SAMPLE)
    masked_rec = {**codec, "loss_mask": np.array(codec["loss_mask"])}
    mask_labels(masked_rec, k)
    dropped, masked = collate_bins([broken], cfg), collate_bins([masked_rec], cfg)
    [d] = dropped.dropped  # type: ignore[attr-defined]
    assert d.sample_id == OV2_SAMPLE and "codec" in d.error, d
    assert good.dropped == () and good.image_grid_thw.tolist().count(codec_grid(codec)) == 1  # one grid row
    _assert_dropped_like_masked(dropped, masked, good, int(np.prod(codec_grid(codec))))


def test_the_scan_rejects_a_video_with_zeroed_frame_bytes(tmp_path: Path) -> None:
    path = encode_video(tmp_path / "v.mp4", 30, gop=10)
    damaged = tmp_path / "zeroed.mp4"
    damaged.write_bytes(zero_frame_bytes(path.read_bytes()))
    with pytest.raises(VideoProbeError) as info:
        probe_video(damaged)
    assert info.value.reason == "undecodable_video" and "zeroed.mp4" in info.value.message
    # controls: the intact file passes, and without the frame check (the header alone) so does the damaged one
    assert probe_video(path).meta.total_frames == 30
    assert probe_video(damaged, VideoProbeConfig(decode_ends=False)).meta.total_frames == 30


@pytest.mark.ranks
@pytest.mark.slow
def test_training_drops_the_sample_and_matches_its_masked_bin(
    datasets: dict[str, Path], tmp_path: Path
) -> None:
    """One rank, two steps over every bin (the damaged one in both): the run completes, names the sample in its
    log and in bad_samples-rank0.jsonl, counts it, and its losses equal the masked dataset's to 1e-6;
    `--strict-data` (through a loader worker) stops at the first batch with one line."""
    from tests.support.trainer import ok, train

    n_bins = load_manifest(str(datasets["good"])).num_bins
    args = ["--micro-batch-size", str(n_bins), "--global-batch-size", str(n_bins), "--train-iters", "2"]
    # the damaged run's batches come from a loader worker (the dropped samples travel with them)
    damaged_args = [*args, "--data-path", str(datasets["damaged"]), "--num-workers", "1"]
    damaged = ok(train(1, damaged_args, tmp_path / "damaged"))
    masked = ok(train(1, [*args, "--data-path", str(datasets["masked"])], tmp_path / "masked"))
    assert [m["bad_samples"] for m in damaged.train] == [1, 2]
    assert [m["bad_samples"] for m in masked.train] == [0, 0]
    assert [m["target_tokens"] for m in damaged.train] == [m["target_tokens"] for m in masked.train]
    np.testing.assert_allclose(damaged.losses(), masked.losses(), rtol=0, atol=1e-6)
    assert " bad samples: 2 |" in damaged.stdout and " bad samples:" not in masked.stdout
    warning = f"rank 0: dropped sample '{BAD_SAMPLE}' of {datasets['damaged']}"
    assert damaged.stderr.count(warning) == 2 and "videos/clip_0000.mp4 cannot be decoded" in damaged.stderr
    listed = [
        json.loads(line)
        for line in (tmp_path / "damaged" / "bad_samples-rank0.jsonl").read_text().splitlines()
    ]
    assert [(r["sample_id"], r["media"], r["iteration"], r["phase"]) for r in listed] == [
        (BAD_SAMPLE, "videos/clip_0000.mp4", i, "train") for i in (1, 2)
    ]
    assert listed[0]["dataset"] == str(datasets["damaged"]) and listed[0]["error"]
    assert not (tmp_path / "masked" / "bad_samples-rank0.jsonl").exists()

    strict = train(
        1,
        [*args, "--data-path", str(datasets["damaged"]), "--strict-data", "--num-workers", "1"],
        tmp_path / "strict",
    )
    assert strict.returncode != 0 and strict.train == []
    lines = [line for line in strict.stderr.splitlines() if line.startswith("pretrain_vlm: error:")]
    assert len(lines) == 1 and "Traceback" not in strict.stderr, strict.stderr[-3000:]
    assert (
        lines[0].startswith(f"pretrain_vlm: error: sample '{BAD_SAMPLE}' (bin ")
        and "clip_0000.mp4" in lines[0]
    )
