"""The packer's LLaVA-OneVision-2 video rule against that project's own processor (../shared/reference/
llava_onevision2, loaded in tests only): `Llava_Onevision2Processor.from_pretrained(DIR)` on the model folder the
packer reads, on the real demo videos. Harness, not reference: the reference decodes with decord or OpenCV
(not installed here), so its `extract_video_frames` is replaced by one that takes the container's frame count
and rate (what those decoders report) through the reference's own `choose_target_frames`,
`select_frame_indices`, `smart_resize` and `format_timestamp`, and hands blank frames of that size on (token
ids do not depend on pixel values); the reference's video processor, image processor, text rewrite and
tokenizer then run as they are."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import MLLM_DEMO_JSON, QWEN3_TOKENIZER, SHARED_DIR

REFERENCE_DIR = SHARED_DIR / "reference"
VIDEO_DEMO = SHARED_DIR / "data" / "mllm_video_demo"
IMAGE_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 14,
    "temporal_patch_size": 1,
    "merge_size": 2,
    "min_pixels": 3136,
    "max_pixels": 1605632,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A OneVision-2 model folder as far as the packer and the processor read it."""
    if not (
        QWEN3_TOKENIZER.is_file() and (REFERENCE_DIR / "llava_onevision2").is_dir() and VIDEO_DEMO.is_dir()
    ):
        pytest.skip("needs ../shared (the OneVision-2 reference, mllm_video_demo and the Qwen3 tokenizer)")
    out = tmp_path_factory.mktemp("ov2_folder")
    (out / "config.json").write_text(json.dumps({"model_type": "llava_onevision2"}))
    (out / "preprocessor_config.json").write_text(json.dumps(IMAGE_CONFIG))
    shutil.copy(QWEN3_TOKENIZER, out / "tokenizer.json")
    shutil.copy(QWEN3_TOKENIZER.parent / "tokenizer_config.json", out / "tokenizer_config.json")
    return out


def _reference_processor(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The reference processor of `folder`, its frame extraction swapped for the harness above."""
    from PIL import Image

    from mmpack.offline_packing.inputs.video_probe import probe_video

    if str(REFERENCE_DIR) not in sys.path:
        sys.path.insert(0, str(REFERENCE_DIR))
    from llava_onevision2 import processing_llava_onevision2 as processing
    from llava_onevision2 import video_processing_llava_onevision2 as video

    def extract(video_path: str, **kw: Any) -> tuple[list, Any, dict]:
        import torch

        meta = probe_video(video_path).meta
        count = video.choose_target_frames(
            meta.total_frames / meta.fps, kw["max_frames"], kw["fixed_num_frames"], kw["target_fps"]
        )
        indices = video.select_frame_indices(meta.total_frames, count)
        h, w = video.smart_resize(
            meta.height, meta.width, kw["patch_size"], min_pixels=kw["min_pixels"], max_pixels=kw["max_pixels"],
            align_patch_size=kw["patch_size"] * kw["spatial_merge_size"],
        )  # fmt: skip
        frames = [Image.new("RGB", (w, h)) for _ in indices]
        stamps = {str(int(i)): video.format_timestamp(int(i) / meta.fps) for i in indices}
        return frames, torch.tensor(indices, dtype=torch.int64), stamps

    monkeypatch.setattr(video, "extract_video_frames_to_pil", extract)
    return processing.Llava_Onevision2Processor.from_pretrained(str(folder))


def _videos() -> list[Path]:
    records = json.loads((VIDEO_DEMO / "mllm_video_demo.json").read_text())
    return [VIDEO_DEMO / rel for rec in records for rel in rec["videos"]]


def test_video_tokens_equal_the_reference_processor(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model DIR`'s video rule: frames, grid and every token id of a video sample (timestamps, one
    `<|image_pad|>` block per frame) are the reference processor's; the per-frame patch positions too."""
    from mmpack.offline_packing.inputs.video_probe import probe_video
    from mmpack.offline_packing.model_folder import resolve_image_rule, resolve_video_rule
    from mmpack.packing import video_tokens_ov2
    from mmpack.packing.chat import Conversation, encode_texts, finish_tokenized, prepare_conversation
    from mmpack.packing.tokenizer import load_tokenizer
    from mmpack.packing.video_tokens_qwen3 import placeholder_ids

    _, image_rule = resolve_image_rule(str(folder), None, {})
    rule = resolve_video_rule(str(folder), None, {}, image_rule)
    assert rule.style == "llava_onevision2"
    proc = _reference_processor(folder, monkeypatch)
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    for path in _videos():
        plan = rule.plan(probe_video(path).meta)
        conv = Conversation(
            messages=(("user", "<video>Why is it funny?"), ("assistant", "A baby reads.")),
            videos=(str(path),),
        )
        blocks = [video_tokens_ov2.block_ids(tokenizer, plan)]
        prep = prepare_conversation(conv, tokenizer, [], None, [plan.num_tokens], blocks, True)
        [ours] = finish_tokenized([prep], tokenizer, encode_texts(tokenizer, [prep.text]))
        theirs = proc(text=[prep.text], videos=[str(path)])
        assert ours.input_ids.tolist() == theirs["input_ids"][0].tolist(), path.name
        t, h, w = plan.grid_thw
        assert theirs["image_grid_thw"].tolist() == [[1, h, w]] * t, path.name
        assert plan.num_tokens == int((ours.input_ids == tokenizer.special_ids["image_pad"]).sum())
        # the frames' real indices are the patches' t (the reference's training convention)
        assert theirs["patch_positions"][:: h * w, 0].tolist() == list(plan.frame_indices), path.name
        span = slice(*ours.video_spans[0])
        assert (
            ours.loss_mask[span].sum() == 0
            and ours.input_ids[span][-1] == tokenizer.special_ids["vision_end"]
        )
        # controls: Qwen3-VL's expansion (the pad alone replaced, video pads) is not this processor's text
        qwen3 = prepare_conversation(
            conv, tokenizer, [], None, [plan.num_tokens], [placeholder_ids(tokenizer, plan)]
        )
        [other] = finish_tokenized([qwen3], tokenizer, encode_texts(tokenizer, [qwen3.text]))
        assert other.input_ids.tolist() != theirs["input_ids"][0].tolist()


def test_model_folder_video_rule_and_its_flags(folder: Path) -> None:
    """A OneVision-2 folder gives the processor's defaults; the processor's own arguments may be set, the
    other --video-* flags are refused in one line; the manifest entry round-trips."""
    from mmpack.offline_packing.model_folder import resolve_image_rule, resolve_video_rule
    from mmpack.packing.video_tokens import VideoMeta, VideoTokenRule

    _, image = resolve_image_rule(str(folder), None, {})
    rule = resolve_video_rule(str(folder), None, {}, image)
    assert (rule.max_frames, rule.min_pixels, rule.max_pixels) == (384, 200704, 1605632)
    assert (rule.image_min_pixels, rule.image_max_pixels, rule.temporal_patch_size) == (3136, 1605632, 1)
    assert VideoTokenRule.from_dict(rule.to_dict()) == rule
    assert "image_min_pixels" not in VideoTokenRule().to_dict()  # other rules' manifests stay as they were
    assert resolve_video_rule(str(folder), None, {"video_max_frames": 32}, image).max_frames == 32
    with pytest.raises(ValueError, match="--video-fps: --model"):
        resolve_video_rule(str(folder), None, {"video_fps": 1.0}, image)
    with pytest.raises(ValueError, match="--video-rule qwen3_vl disagrees"):
        resolve_video_rule(str(folder), None, {"video_style": "qwen3_vl"}, image)
    # frame sampling against the reference's own functions, over lengths around the 10 s / 30 s steps
    if str(REFERENCE_DIR) not in sys.path:
        sys.path.insert(0, str(REFERENCE_DIR))
    from llava_onevision2 import video_processing_llava_onevision2 as video

    for fps in (10.0, 23.976023976023978, 29.97, 60.0):
        for n in (1, 5, 9, 99, 100, 239, 240, 299, 300, 383, 384, 385, 899, 900, 901, 5000, 123457):
            meta = VideoMeta(total_frames=n, fps=fps, width=640, height=360, duration_s=n / fps)
            theirs = video.select_frame_indices(n, video.choose_target_frames(n / fps, 384))
            plan = rule.plan(meta)
            assert list(plan.frame_indices) == theirs, (n, fps)
            assert list(plan.timestamps_s) == [
                video.time_str_to_seconds(video.format_timestamp(i / fps)) for i in theirs
            ]


def test_pack_writes_the_reference_tokens_and_the_trainer_refuses_videos_in_one_line(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mmpack pack --model DIR` on the real video records: each sample's ids in the bins are the reference
    processor's for its text; the manifest names the rule; the trainer (which does not take these videos yet)
    refuses the dataset in one line."""
    from mmpack.dataloader import load_manifest
    from mmpack.dataloader.readers import open_shard_reader
    from mmpack.offline_packing.cli import main as mmpack
    from mmpack.packing import video_tokens_ov2
    from mmpack.packing.tokenizer import load_tokenizer
    from mmpack.packing.video_tokens import VideoPlan
    from mmpack.trainer.build import check_data_matches_model
    from mmpack.trainer.data import dataset_info
    from mmpack.trainer.models import family
    from mmpack.trainer.models.protocol import TinyModelSpec

    shutil.copytree(VIDEO_DEMO / "mllm_demo_data", tmp_path / "mllm_demo_data")
    image = next((MLLM_DEMO_JSON.parent / "mllm_demo_data").glob("*.jpg"))
    shutil.copy(image, tmp_path / "mllm_demo_data" / "image.jpg")
    records = json.loads((VIDEO_DEMO / "mllm_video_demo.json").read_text())
    video = records[0]["videos"]
    turn = {"role": "assistant", "content": "A baby."}
    records += [  # refused: its processor mixes images and videos up; text that merges with the first timestamp
        {"messages": [{"role": "user", "content": "<image><video>Same?"}, turn], "videos": video,
         "images": ["mllm_demo_data/image.jpg"]},
        {"messages": [{"role": "user", "content": "Look:<video>"}, turn], "videos": video},
    ]  # fmt: skip
    src = tmp_path / "videos.json"
    src.write_text(json.dumps(records))
    packed = tmp_path / "packed"
    assert (
        mmpack(
            ["pack", "-i", str(src), "-o", str(packed), "-L", "4096", "--model", str(folder), "--no-progress"]
        )
        == 0
    )
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["video_rule"]["style"] == "llava_onevision2" and manifest["counts"]["samples_packed"] == 3
    rejects = [json.loads(line) for line in (packed / "rejects.jsonl").read_text().splitlines()]
    assert sorted(r["reason"] for r in rejects) == ["video_timestamp_merge", "video_with_images"]
    # each packed sample, its video blocks folded back to the template's one pad, through the reference
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    proc = _reference_processor(folder, monkeypatch)
    fold = [tokenizer.special_ids[k] for k in ("vision_start", "video_pad", "vision_end")]
    m = load_manifest(str(packed))
    checked = 0
    for shard in m.shards:
        reader = open_shard_reader(str(packed / shard.path), shard.format, label=shard.path)
        for i in range(shard.bins):
            rec = reader.read(i)
            ids = np.asarray(rec["input_ids"]).tolist()
            starts = np.cumsum([0, *rec["seq_lens"]]).tolist()
            plans = iter(rec["video_plans"])
            for a, b in itertools.pairwise(starts):
                sample = ids[a:b]
                stored = next(plans)
                block = video_tokens_ov2.block_ids(tokenizer, VideoPlan.from_dict(stored)).tolist()
                at = next(k for k in range(len(sample)) if sample[k : k + len(block)] == block)
                text = proc.tokenizer.decode(sample[:at] + fold + sample[at + len(block) :])
                assert (
                    proc(text=[text], videos=[str(tmp_path / stored["source"])])["input_ids"][0].tolist()
                    == sample
                )
                checked += 1
        reader.close()
    assert checked == 3
    info = dataset_info(str(packed), 0)
    ids = {t["content"]: t["id"] for t in json.loads(QWEN3_TOKENIZER.read_text())["added_tokens"]}
    spec = TinyModelSpec(
        vocab_size=151936, image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], vision_hidden_size=64,
    )  # fmt: skip
    fam = family("llava_onevision2")
    arch = fam.arch_from_hf_config(fam.tiny_hf_config(spec))
    with pytest.raises(ValueError, match="holds videos, which mmpack does not train llava_onevision2 on yet"):
        check_data_matches_model(fam, arch, info, "x")
    check_data_matches_model(
        fam, arch, dataclasses.replace(info, video_rule="", video_pad_id=-1), "x"
    )  # control
