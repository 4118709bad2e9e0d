"""Video rules are a registry of styles (`mmpack.packing.video_rules`): a fake rule (`tests.support.fake_video_rule`:
frames from the end backwards at a fixed small size), registered by one registry line and known to nothing
else, is chosen by `--video-rule`, plans the videos of a packed dataset, is recorded in its manifest, is what the
loader decodes, and trains a step. Controls: the loader's frames are not those of the same plan in the usual
(increasing) order, and the dataset does not load once the rule is unregistered."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmpack.packing import video_rules
from tests.support import fake_video_rule
from tests.support.fake_video_rule import FAKE_STYLE
from tests.support.trainer import ok, train

SEQ_LEN = 1024
# each rank runs the trainer with the fake rule registered
RANK_ENTRY = Path(__file__).parent / "support" / "fake_video_family.py"


@pytest.fixture(scope="module")
def registered() -> Iterator[None]:
    """The fake rule in the registry, for this module's tests (the one registry line)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(video_rules.VIDEO_RULES, FAKE_STYLE, fake_video_rule.MODULE)
        yield


@pytest.fixture(scope="module")
def packed(registered: None, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two synthetic image records and four video records (three tiny clips, one record with an image and two
    of them), packed into one bin with the fake rule chosen by name."""
    from mmpack.demo.synthetic import make_synthetic_dataset, pack_synthetic, train_tiny_bpe
    from mmpack.demo.videos import add_synthetic_videos

    root = tmp_path_factory.mktemp("fake-video-rule")
    raw = make_synthetic_dataset(root / "raw", n_samples=2, seed=5, size_range=(28, 84), max_words=20)
    raw = add_synthetic_videos(raw, 3, seed=5)
    tokenizer = train_tiny_bpe(root / "tok", seed=5, video_pad=True)
    out = root / "packed"
    summary = pack_synthetic(raw, tokenizer, out, seq_len=SEQ_LEN, format="arrow", video_style=FAKE_STYLE)
    assert summary.samples_rejected == 0, summary.rejected_by_reason
    return {"out": out, "media": raw.image_root}


def _bin(out: Path) -> dict:
    from mmpack.dataloader import load_manifest
    from mmpack.dataloader.readers import open_shard_reader

    manifest = load_manifest(str(out))
    [shard] = manifest.shards
    assert shard.bins == 1
    return dict(open_shard_reader(str(out / shard.path), shard.format, label=shard.path).read(0))


def _loaded_batch(out: Path) -> Any:
    """The loader's one micro-batch of the dataset (one bin, decoded in this process)."""
    from mmpack.dataloader import Topology, build_loader

    loader = build_loader(
        str(out), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=0, num_epochs=1,
    )  # fmt: skip
    [batch] = list(loader)
    loader.close()
    return batch


def _expected_patches(plans: list, media: Path, image_rule: object, order: str = "plan") -> np.ndarray:
    """The patches of each video's planned frames, decoded the plainest way (every frame, then picked)."""
    from mmpack.dataloader.video import resize_frame, video_to_patches
    from mmpack.packing.video_tokens import VideoPlan
    from tests.support.video_fixtures import reference_frames

    rows = []
    for stored in plans:
        plan = VideoPlan.from_dict(stored)
        if order == "increasing":  # the control: the same frames in the order the other rules give
            plan = dataclasses.replace(plan, frame_indices=tuple(sorted(plan.frame_indices)))
        frames = [resize_frame(f, plan.resized_hw) for f in reference_frames(media / stored["source"], plan)]
        rows.append(video_to_patches(np.stack(frames), image_rule))  # type: ignore[arg-type]
    return np.concatenate(rows)


def test_the_registered_rule_plans_the_videos_and_the_loader_decodes_its_plan(packed: dict) -> None:
    from mmpack.dataloader import load_manifest
    from mmpack.offline_packing.inputs.video_probe import probe_video
    from mmpack.offline_packing.model_folder import resolve_video_rule
    from mmpack.packing.image_tokens import ImageTokenRule
    from mmpack.packing.video_tokens import VideoTokenRule

    chosen = resolve_video_rule(None, None, {"video_style": FAKE_STYLE}, ImageTokenRule())
    assert chosen.kind is fake_video_rule.VIDEO_STYLE
    out, media = packed["out"], packed["media"]
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["video_rule"]["style"] == FAKE_STYLE and raw["counts"]["videos"] == 5
    manifest = load_manifest(str(out))
    rule = manifest.dataset.video_rule
    assert rule is not None and rule.kind is fake_video_rule.VIDEO_STYLE
    assert VideoTokenRule.from_dict(rule.to_dict()) == rule
    record = _bin(out)
    plans = list(record["video_plans"])
    for stored in plans:  # each recorded plan is the fake rule's, from the video's metadata
        planned = rule.plan(probe_video(media / stored["source"]).meta).to_dict()
        assert {k: stored[k] for k in planned} == planned
        indices = stored["frame_indices"]
        assert len(indices) == 4 and indices == sorted(indices, reverse=True)
        assert stored["grid_thw"] == [2, 4, 4]
    batch = _loaded_batch(out)
    assert batch.video_grid_thw.tolist() == [[2, 4, 4]] * 5
    got = batch.pixel_values_videos.numpy()
    np.testing.assert_array_equal(got, _expected_patches(plans, media, manifest.image_rule))
    # control: the same frames in increasing order (as every other rule samples them) are not what was loaded
    assert not np.array_equal(got, _expected_patches(plans, media, manifest.image_rule, order="increasing"))
    pads = int((batch.tokens == manifest.video_pad_id).sum())
    assert pads == sum(p["num_tokens"] for p in plans) == 5 * 8


def test_a_style_by_name_starts_from_its_defaults_and_a_folder_claimed_twice_is_refused(
    tmp_path: Path,
) -> None:
    """`--video-rule NAME` gives that style's defaults with the flags over them (Qwen3-VL's processor defaults,
    then --video-fps); a model folder two styles claim is refused in one line naming both."""
    from mmpack.offline_packing.model_folder import resolve_video_rule
    from mmpack.packing import video_tokens_qwen3 as qwen3
    from mmpack.packing.image_tokens import ImageTokenRule

    image = ImageTokenRule(patch_size=16)
    rule = resolve_video_rule(None, None, {"video_style": "qwen3_vl", "video_fps": 1.0}, image)
    assert (rule.style, rule.fps) == ("qwen3_vl", 1.0)
    assert rule.max_pixels == qwen3.PROCESSOR_DEFAULTS["max_pixels"]
    config = {"video_processor_type": qwen3.PROCESSOR_TYPE}
    (tmp_path / qwen3.VIDEO_PREPROCESSOR_CONFIG).write_text(json.dumps(config))
    assert resolve_video_rule(str(tmp_path), None, {}, image).style == "qwen3_vl"  # control: one claim
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava_onevision2"}))
    with pytest.raises(ValueError, match=r"matches more than one video rule: qwen3_vl .*, llava_onevision2"):
        resolve_video_rule(str(tmp_path), None, {}, image)


def test_the_dataset_does_not_load_without_the_rule(packed: dict) -> None:
    """Control: the fake is known through the registry alone."""
    from mmpack.dataloader import load_manifest

    with pytest.MonkeyPatch.context() as mp:
        mp.delitem(video_rules.VIDEO_RULES, FAKE_STYLE)
        with pytest.raises(ValueError, match=f"video rule style must be one of .*got '{FAKE_STYLE}'"):
            load_manifest(str(packed["out"]))


@pytest.mark.ranks
@pytest.mark.slow
def test_one_training_step_on_the_fake_rules_videos(packed: dict, tmp_path: Path) -> None:
    """One rank, the tiny Qwen2.5-VL as a family whose processor follows the fake rule: one step over the bin
    and its five videos (every target token of the loader's batch, a finite loss)."""
    from mmpack.packing.layout import IGNORE_INDEX

    batch = _loaded_batch(packed["out"])
    assert batch.video_grid_thw.tolist() == [[2, 4, 4]] * 5
    args = ["--data-path", str(packed["out"]), "--micro-batch-size", "1", "--global-batch-size", "1"]
    run = ok(train(1, [*args, "--train-iters", "1"], tmp_path, entry=(str(RANK_ENTRY),)))
    [step] = run.train
    assert math.isfinite(step["loss"])
    assert step["target_tokens"] == int((batch.labels != IGNORE_INDEX).sum()) > 0
