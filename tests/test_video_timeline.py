"""Videos are planned from the frames the decoder shows: an edit list (a stream-copy cut) is honoured, a timescale
of 1 is rejected at scan time, `--video-check decode` catches what only a decode finds, and a loader error names
the video as the record did and its sample, not only the bin."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import av
import numpy as np
import pytest

from mmpack.dataloader.collate import BadSampleError, CollateConfig, collate_bins
from mmpack.dataloader.manifest import load_manifest
from mmpack.dataloader.readers import ArrowShardReader
from mmpack.dataloader.video import decode_planned_frames, resize_frame
from mmpack.offline_packing.errors import VideoProbeError
from mmpack.offline_packing.inputs.video_probe import probe_video
from mmpack.offline_packing.options import job_config
from mmpack.offline_packing.pipeline import read_manifest, run_pack
from mmpack.packing.video_tokens import VideoTokenRule
from tests.support.fixtures_data import train_tiny_bpe
from tests.support.video_fixtures import (
    encode_video,
    reference_frames,
    stream_copy_cut,
    timescale_one,
    zero_frame_packet,
)


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    media = tmp_path_factory.mktemp("clips") / "media"
    media.mkdir()
    source = encode_video(media / "source.mp4", 50, gop=25)
    stream_copy_cut(source, media / "cut.mp4", 12)
    timescale_one(source, media / "ts1.mp4")
    # frame 10's bytes zeroed, the index intact: between the keyframes (0, 25) the scan decodes, before planned frame 16
    zero_frame_packet(source, media / "zeroed.mp4", 10)
    return media


def test_edit_list_cut_is_planned_over_the_frames_the_decoder_shows(clips: Path) -> None:
    cut = clips / "cut.mp4"
    with av.open(str(cut)) as container:
        assert container.streams.video[0].frames == 50  # control: the sample table counts the hidden frames
    meta = probe_video(cut).meta
    assert meta.total_frames == 38 and meta.frame_count_exact  # 50 - 12 discarded before the cut
    plan = VideoTokenRule(fps=25).plan(meta)  # every shown frame sampled, the last one included
    assert plan.frame_indices[-1] == 37
    got = decode_planned_frames(cut, plan)
    want = np.stack([resize_frame(f, plan.resized_hw) for f in reference_frames(cut, plan)])
    np.testing.assert_array_equal(got, want)


def test_timescale_one_is_rejected_at_scan_time(clips: Path) -> None:
    with pytest.raises(VideoProbeError) as info:
        probe_video(clips / "ts1.mp4")
    assert info.value.reason == "video_timestamps" and "video_track_timescale" in info.value.message


def _pack(clips: Path, out: Path, **kw) -> None:
    turns = [{"from": "human", "value": "<video>What moves?"}, {"from": "gpt", "value": "A bar."}]
    records = [
        {"id": f"clip-{name}", "video": f"media/{name}", "conversations": turns}
        for name in ("cut.mp4", "zeroed.mp4")
    ]
    data = clips.parent / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = train_tiny_bpe(clips.parent / "tok", video_pad=True)
    cfg = job_config(
        inputs=(str(data),), output=str(out), seq_len=2048, tokenizer=str(tok), progress=False, **kw
    )
    run_pack(cfg)


def test_video_check_decode_rejects_what_the_loader_would_fail_on(clips: Path, tmp_path: Path) -> None:
    _pack(clips, tmp_path / "checked", video_check="decode")
    counts = read_manifest(str(tmp_path / "checked"))["counts"]
    assert counts["samples_packed"] == 1 and counts["rejected_by_reason"] == {"undecodable_video": 1}
    # without the check the file is packed, and the loader's error names the video and its sample
    out = tmp_path / "header"
    _pack(clips, out)
    assert read_manifest(str(out))["counts"]["samples_packed"] == 2
    manifest = load_manifest(str(out))
    cfg = dataclasses.replace(CollateConfig.from_manifest(manifest), strict_data=True)  # else it is dropped
    shard = manifest.shards[0]
    reader = ArrowShardReader(str(out / shard.path), label=shard.path)
    records = [reader.read(i) for i in range(len(reader))]
    reader.close()
    with pytest.raises(BadSampleError, match=r"video media/zeroed\.mp4 of sample 'clip-zeroed.mp4' \(bin "):
        for rec in records:
            collate_bins([rec], cfg)
