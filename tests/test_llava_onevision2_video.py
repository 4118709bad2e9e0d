"""The packer's LLaVA-OneVision-2 video rule against that project's own processor (../shared/reference/
llava_onevision2, loaded in tests only): `Llava_Onevision2Processor.from_pretrained(DIR)` on the model folder the
packer reads, on the real demo videos. Harness, not reference: the reference decodes with decord or OpenCV
(not installed here), so its `extract_video_frames` is replaced by one that takes the container's frame count
and rate (what those decoders report) through the reference's own `choose_target_frames`,
`select_frame_indices`, `smart_resize` and `format_timestamp`, and hands blank frames of that size on (token
ids do not depend on pixel values); the reference's video processor, image processor, text rewrite and
tokenizer then run as they are."""

from __future__ import annotations

import itertools
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import onevision
from tests.support.hf_parity import torchrun, train_args
from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, SHARED_DIR, need_shared

pytestmark = [pytest.mark.family, pytest.mark.shared]

REFERENCE_DIR = SHARED_DIR / "reference"
VIDEO_DEMO = SHARED_DIR / "data" / "mllm_video_demo"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A OneVision-2 model folder as far as the packer and the processor read it."""
    need_shared(
        QWEN3_TOKENIZER,
        REFERENCE_DIR / "llava_onevision2",
        VIDEO_DEMO,
        what="the OneVision-2 reference, mllm_video_demo and the Qwen3 tokenizer",
    )
    out = tmp_path_factory.mktemp("ov2_folder")
    (out / "config.json").write_text(json.dumps({"model_type": "llava_onevision2"}))
    (out / "preprocessor_config.json").write_text(json.dumps(onevision.VIDEO_IMAGE_CONFIG))
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


def test_pack_writes_the_reference_tokens(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mmpack pack --model DIR` on the real video records: each sample's ids in the bins are the reference
    processor's for its text; the manifest names the rule; a sample with images and a video, and text that
    merges with the first timestamp, are rejects."""
    from mmpack.cli import main as mmpack
    from mmpack.dataloader import load_manifest
    from mmpack.dataloader.readers import open_shard_reader
    from mmpack.packing import video_tokens_ov2
    from mmpack.packing.tokenizer import load_tokenizer
    from mmpack.packing.video_tokens import VideoPlan

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
    records.insert(1, {"messages": [{"role": "user", "content": "<image><image>Two?"}, turn],
                       "images": ["mllm_demo_data/image.jpg"] * 2})  # fmt: skip
    src = tmp_path / "videos.json"
    src.write_text(json.dumps(records))
    packed = tmp_path / "packed"
    assert (
        mmpack(
            ["pack", "-i", str(src), "-o", str(packed), "-L", "8192", "--model", str(folder), "--no-progress"]
        )
        == 0
    )
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["video_rule"]["style"] == "llava_onevision2" and manifest["counts"]["samples_packed"] == 4
    rejects = [json.loads(line) for line in (packed / "rejects.jsonl").read_text().splitlines()]
    assert sorted(r["reason"] for r in rejects) == ["video_timestamp_merge", "video_with_images"]
    # each packed sample, its video blocks folded back to the template's one pad, through the reference
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    proc = _reference_processor(folder, monkeypatch)
    fold = [tokenizer.special_ids[k] for k in ("vision_start", "video_pad", "vision_end")]
    m = load_manifest(str(packed))
    checked = images_seen = 0
    for shard in m.shards:
        reader = open_shard_reader(str(packed / shard.path), shard.format, label=shard.path)
        for i in range(shard.bins):
            rec = reader.read(i)
            ids = np.asarray(rec["input_ids"]).tolist()
            starts = np.cumsum([0, *rec["seq_lens"]]).tolist()
            plans = list(rec["video_plans"])
            for a, b in itertools.pairwise(starts):
                sample = ids[a:b]
                stored = plans[0] if plans else {}
                block = (
                    video_tokens_ov2.block_ids(tokenizer, VideoPlan.from_dict(stored)).tolist()
                    if plans
                    else []
                )
                at = next(
                    (k for k in range(len(sample)) if block and sample[k : k + len(block)] == block), None
                )
                if at is None:  # the image sample (its ids are the image rule's, tested elsewhere)
                    images_seen += 1
                    continue
                plans.pop(0)
                text = proc.tokenizer.decode(sample[:at] + fold + sample[at + len(block) :])
                assert (
                    proc(text=[text], videos=[str(tmp_path / stored["source"])])["input_ids"][0].tolist()
                    == sample
                )
                checked += 1
        reader.close()
    assert (checked, images_seen) == (3, 1)
    _check_loader_frames(packed)


def _check_loader_frames(packed: Path) -> None:
    """The loader's micro-batch of a bin with video and image samples: each sample's images or frames in
    token order (one grid each, as many pads), and the frames' patch positions at t = their frame indices."""
    import torch

    from mmpack.dataloader import Topology, build_loader, load_manifest
    from mmpack.dataloader.readers import open_shard_reader
    from mmpack.packing.batch import contract_problems
    from mmpack.packing.patch_positions import TextPositionRule, block_patch_positions

    m = load_manifest(str(packed))
    assert m.shards and sum(s.bins for s in m.shards) == 1
    reader = open_shard_reader(str(packed / m.shards[0].path), m.shards[0].format, label="shard")
    rec = reader.read(0)
    reader.close()
    loader = build_loader(
        str(packed), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=1, num_epochs=1, position_rule=TextPositionRule(merge_size=2),
    )  # fmt: skip
    batch = next(iter(loader))
    loader.close()
    assert contract_problems(batch) == [] and len(batch.video_grid_thw) == 0
    plans = list(rec["video_plans"])
    pad = m.image_pad_id
    grids, row, expected_t = batch.image_grid_thw.tolist(), 0, []
    images_seen = 0
    for a, b in itertools.pairwise(batch.cu_seqlens.tolist()[: len(rec["seq_lens"]) + 1]):
        pads = int((batch.tokens[0, a:b] == pad).sum())
        taken = []
        while sum(t * h * w for t, h, w in taken) // 4 < pads:
            taken.append(grids[row])
            row += 1
        assert sum(t * h * w for t, h, w in taken) // 4 == pads
        frames = plans[0]["frame_indices"] if plans else []
        if plans and taken == [[1, *plans[0]["grid_thw"][1:]]] * len(frames):
            expected_t += [i for i in frames for _ in range(taken[0][1] * taken[0][2])]
            plans.pop(0)
        else:
            assert len(taken) == 2  # the two images, not frames
            expected_t += [0] * sum(t * h * w for t, h, w in taken)
            images_seen += 1
    assert images_seen == 1 and not plans
    assert row == len(grids)
    positions = batch.patch_positions.numpy()
    assert positions[:, 0].tolist() == expected_t
    assert torch.equal(batch.patch_positions[:, 1:], torch.from_numpy(block_patch_positions(grids, 2)[:, 1:]))


def _video_records(root: Path) -> Path:
    shutil.copytree(VIDEO_DEMO / "mllm_demo_data", root / "mllm_demo_data")
    shutil.copy(VIDEO_DEMO / "mllm_video_demo.json", root / "videos.json")
    return root / "videos.json"


def _bin_video_sources(packed: Path, bin_id: int) -> list[str]:
    """The videos of global bin ``bin_id`` in sample order (the names its record keeps)."""
    from mmpack.dataloader import load_manifest
    from mmpack.dataloader.readers import open_shard_reader

    m = load_manifest(str(packed))
    shard = m.shards[m.shard_index(bin_id)]
    reader = open_shard_reader(str(packed / shard.path), shard.format, label=shard.path)
    sources = [plan["source"] for plan in reader.read(bin_id - shard.first_bin)["video_plans"]]
    reader.close()
    return sources


def _reference_video_loss(
    hf_dir: Path, packed: Path, root: Path, *, bins: int = 1, edit: Any = None
) -> dict[str, Any]:
    """The reference model's (dense or MoE, as config.json says) loss over the samples of the first ``bins``
    bins one by one: the loader's pixels, the processor's grids ([1, h, w] per frame) and its
    `build_patch_positions` with the frame indices its own sampling picks from the container's metadata;
    `zeroed` and `shuffled` (frames in reverse order) are the controls; ``edit``: a function applied to the
    loaded model first (controls)."""
    import torch

    from mmpack.dataloader import Topology, build_loader

    config = json.loads((hf_dir / "config.json").read_text())
    model = (
        onevision.reference_classes(config["model_type"])[1]
        .from_pretrained(hf_dir, dtype=torch.float32)
        .eval()
    )
    if edit is not None:
        edit(model)
    manifest = json.loads((packed / "manifest.json").read_text())
    loader = build_loader(
        str(packed), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=0, num_epochs=1,
    )  # fmt: skip
    totals = {"loss": 0.0, "zeroed": 0.0, "shuffled": 0.0}
    count = 0
    for batch in itertools.islice(loader, bins):
        sources = [root / name for name in _bin_video_sources(packed, int(batch.bin_ids[0]))]
        count += _add_bin_losses(model, batch, sources, manifest, config, totals)
    loader.close()
    return {name: total / count for name, total in totals.items()} | {"tokens": count}


def _add_bin_losses(
    model: Any, batch: Any, sources: list[Path], manifest: dict, config: dict, totals: dict[str, float]
) -> int:
    """Adds each video sample's summed token losses of ``batch`` to ``totals`` (the frames as they are,
    zeroed, in reverse order); returns the loss tokens counted."""
    import torch
    import torch.nn.functional as F

    from mmpack.offline_packing.inputs.video_probe import probe_video

    _, _, video = onevision.reference_modules()
    pad = manifest["tokenizer"]["special_ids"]["image_pad"]
    merge = config["vision_config"]["spatial_merge_size"]
    grids, real, cu = batch.image_grid_thw.tolist(), int(batch.num_real_tokens), batch.cu_seqlens.tolist()
    count, row, frame, videos = 0, 0, 0, iter(sources)
    with torch.no_grad():
        for a, b in itertools.pairwise(cu):
            if b > real:
                break
            tokens, labels = batch.tokens[0, a:b], batch.labels[0, a:b]
            n_pads, taken = int((tokens == pad).sum()), []
            while sum(t * h * w for t, h, w in taken) // merge**2 < n_pads:
                taken.append(grids[frame])
                frame += 1
            rows = sum(t * h * w for t, h, w in taken)
            pixels = batch.pixel_values[row : row + rows]
            row += rows
            t, h, w = len(taken), taken[0][1], taken[0][2]
            meta = probe_video(next(videos)).meta
            n_frames = video.choose_target_frames(meta.total_frames / meta.fps, 384)
            indices = video.select_frame_indices(meta.total_frames, n_frames)
            assert len(indices) == t
            positions = video.build_patch_positions(torch.tensor([[t, h, w]]), spatial_merge_size=merge,
                                                    frame_indices=[torch.tensor(indices)])  # fmt: skip
            per = h * w
            reverse = torch.cat([pixels[k * per : (k + 1) * per] for k in reversed(range(t))])
            keep = labels != -100
            for name, px in (("loss", pixels), ("zeroed", torch.zeros_like(pixels)), ("shuffled", reverse)):
                logits = model(input_ids=tokens[None], pixel_values=px, image_grid_thw=torch.tensor(taken),
                               patch_positions=positions).logits[0]  # fmt: skip
                totals[name] += float(F.cross_entropy(logits[keep].double(), labels[keep], reduction="sum"))
            count += int(keep.sum())
    assert row == len(batch.pixel_values)  # every frame of the bin was one sample's
    return count


def _video_setup(root: Path, length: int, model: Callable[[], Path]) -> dict[str, Any]:
    """The three demo videos under ``root`` packed into bins of ``length`` tokens with the tiny model folder
    ``model()`` gives (the session's)."""
    from mmpack.cli import main as mmpack

    need_shared(
        QWEN3_TOKENIZER,
        REFERENCE_DIR / "llava_onevision2",
        VIDEO_DEMO,
        what="the OneVision-2 reference, mllm_video_demo and the Qwen3 tokenizer",
    )
    hf_dir = model()
    records = _video_records(root)
    packed = root / "packed"
    assert mmpack(["pack", "-i", str(records), "-o", str(packed), "-L", str(length), "--model", str(hf_dir),
                   "--no-progress"]) == 0  # fmt: skip
    counts = json.loads((packed / "manifest.json").read_text())["counts"]
    assert counts["samples_packed"] == 3, counts
    return {"root": root, "hf": hf_dir, "packed": packed, "bins": counts["bins"]}


@pytest.fixture(scope="module")
def dense_videos(
    onevision2_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The dense model; the three videos in one bin; the reference's loss and controls."""
    found = _video_setup(tmp_path_factory.mktemp("ov2-video"), 2048, onevision2_model)
    assert found["bins"] == 1
    return found | {"ref": _reference_video_loss(found["hf"], found["packed"], found["root"])}


@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_video_loss_equals_the_reference(dense_videos: dict[str, Any], tp: int, tmp_path: Path) -> None:
    """A tiny random OneVision-2 (reference classes), the three demo videos packed with `--model`: one
    iteration at lr 0 (TP1, and TP2 with sequence parallelism) logs the reference's loss to 1e-5 (each frame
    an image, its patches at t = the frame's index in the video); zeroed frames and frames in reverse order
    (their pixels meet other frame positions) move the reference's, zeroed patch positions and zeroed vision
    features ours, by over 1e-4."""
    hf_dir, packed, ref = dense_videos["hf"], dense_videos["packed"], dense_videos["ref"]
    args = [*train_args(hf_dir, packed, tp, 1), *(["--sequence-parallel"] if tp > 1 else [])]
    torchrun(tp, ["-m", "tests.support.onevision", str(tmp_path), *args], tmp_path)
    ours = json.loads((tmp_path / "losses.json").read_text())
    print(f"video TP{tp}: loss {ours['loss']!r}, reference {ref['loss']!r}, relative gap "
          f"{abs(ours['loss'] - ref['loss']) / ref['loss']:.2e}; controls {ours}, reference {ref}")  # fmt: skip
    assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for name, value in (("ref zeroed", ref["zeroed"]), ("ref reversed", ref["shuffled"]),
                        ("ours zeroed positions", ours["zeroed_patch_positions"]),
                        ("ours zeroed vision", ours["zeroed_vision"])):  # fmt: skip
        gap = abs(value - ref["loss"]) / ref["loss"]
        assert gap > 1e-4, f"control {name}: the loss moves by only {gap:.2e} (relative)"


@pytest.mark.ranks
@pytest.mark.slow
def test_moe_video_loss_at_ep2_equals_the_reference(
    onevision2_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The MoE variant (4 experts, 2 per token, load-balancing coefficient 0), the three videos in two bins:
    one iteration of both bins at lr 0, EP2 (TP1, DP2, expert TP 1) on two ranks, logs the reference's loss
    over the same samples to 1e-5; controls: zeroed frames, frames in reverse order and two experts of every
    layer swapped move the reference's by over 1e-4."""
    from tests.support.trainer import ok, train

    root = tmp_path_factory.mktemp("ov2-moe-video")
    moe = _video_setup(root, 1152, lambda: onevision2_model("llava_onevision2_moe", **onevision.MOE_FIELDS))
    assert moe["bins"] == 2  # one global batch of two: both bins in the step
    ref = _reference_video_loss(moe["hf"], moe["packed"], root, bins=2)
    swap = onevision.swap_experts  # control: experts 0 and 1 of every layer change places
    swapped = _reference_video_loss(moe["hf"], moe["packed"], root, bins=2, edit=swap)["loss"]
    args = onevision.moe_args(moe, 1, 2, "--train-iters", "1", "--lr", "0")
    [step] = ok(train(2, args, root / "ep2", tiny=False)).train
    print(f"MoE video EP2: loss {step['loss']!r}, reference {ref['loss']!r}, relative gap "
          f"{abs(step['loss'] - ref['loss']) / ref['loss']:.2e}; reference {ref}, swapped experts {swapped!r}")  # fmt: skip
    assert step["target_tokens"] == ref["tokens"]
    assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for name, value in (("ref zeroed", ref["zeroed"]), ("ref reversed", ref["shuffled"]),
                        ("ref swapped experts", swapped)):  # fmt: skip
        gap = abs(value - ref["loss"]) / ref["loss"]
        assert gap > 1e-4, f"control {name}: the loss moves by only {gap:.2e} (relative)"
