"""Mixtures check what must agree (seq_len, token ids, tokenizer; among sources holding images or videos the
vision geometry and normalisation, among those holding videos the video style) and let each source keep its
own pixel budget: a text corpus packed with `-t` alone mixes with image sets packed with `--model DIR`, and
every bin's images are decoded by its own source's rule."""

from __future__ import annotations

import io
import json
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmpack.dataloader import Topology, build_loader, load_manifest
from mmpack.dataloader.collate import CollateConfig, ImageTooLargeError, collate_bins
from mmpack.dataloader.manifest import Manifest
from mmpack.dataloader.mixture import check_sources, vision_source
from mmpack.packing.batch import contract_problems
from mmpack.packing.video_tokens import VideoTokenRule
from tests.support.loader_data import all_records
from tests.support.mixed_sources import MODEL_PIXELS, PIXEL_BUDGETS, SMALL_IMAGE_LIMIT, MixedRuleSources


def test_each_bin_is_decoded_by_its_own_source_rule(mixed_rule_sources: MixedRuleSources) -> None:
    """Micro-batches of the three sources: every image's grid and pixels are those of the model folder's
    processor (transformers' `Qwen2VLImageProcessorPil`) under its own source's `--max-pixels`; the other
    image source's budget gives other grids for many of them; collating by the first source's rule alone (as
    the loader did) gives other pixels, and by img-small's rule refuses img-large's larger images (controls)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    names = list(mixed_rule_sources.sources)
    records = [all_records(p) for p in mixed_rule_sources.sources.values()]
    processors = {
        k: Qwen2VLImageProcessorPil(**{**MODEL_PIXELS, "max_pixels": PIXEL_BUDGETS[n]})
        for k, n in enumerate(names)
        if n in PIXEL_BUDGETS
    }
    other = {k: processors[j] for k, j in zip(processors, reversed(list(processors)))}  # the other budget
    loader = build_loader(
        mixed_rule_sources.pairs(), topology=Topology(0, 1), micro_batch_size=4, global_batch_size=8,
        num_workers=0,
    )  # fmt: skip
    rows: Counter[str] = Counter()
    mixed = differs = images = 0
    control: tuple[list[Any], np.ndarray] | None = None
    large = []  # img-large's bins with an image over img-small's --max-image-pixels
    for batch, _ in zip(loader, range(8)):  # 32 bins
        assert contract_problems(batch) == []
        sources = batch.source_ids.tolist()
        mixed += len({names[s] for s in sources}) == 3  # text and both budgets in one micro-batch
        grids, pixels = [], []
        for s, b in zip(sources, batch.bin_ids.tolist()):
            rows[names[s]] += 1
            for data in records[s][b]["images"]:
                if names[s] == "img-large" and np.prod(Image.open(io.BytesIO(data)).size) > SMALL_IMAGE_LIMIT:
                    large.append(records[s][b])
                ref = processors[s](images=[Image.open(io.BytesIO(data))], return_tensors="np")
                grids.append(ref["image_grid_thw"])
                pixels.append(ref["pixel_values"])
                alt = other[s](images=[Image.open(io.BytesIO(data))], return_tensors="np")
                differs += not np.array_equal(alt["image_grid_thw"], ref["image_grid_thw"])
                images += 1
        if not grids:  # text bins only
            assert batch.pixel_values.shape[0] == 0
            continue
        np.testing.assert_array_equal(batch.image_grid_thw.numpy(), np.concatenate(grids))
        assert float(np.abs(batch.pixel_values.numpy() - np.concatenate(pixels)).max()) <= 1e-5
        if len(set(sources)) == 3:
            control = [records[s][b] for s, b in zip(sources, batch.bin_ids.tolist())], np.concatenate(pixels)
    loader.close()
    assert set(rows) == set(names) and mixed > 0 and control is not None, (rows, mixed)
    assert images > 20 and differs > images // 2, (images, differs)
    first_rule = CollateConfig.from_manifest(load_manifest(str(mixed_rule_sources.sources[names[0]])))
    got = collate_bins(control[0], first_rule).pixel_values
    assert got.shape != control[1].shape or not np.allclose(got, control[1], atol=1e-5)
    small_rule = CollateConfig.from_manifest(load_manifest(str(mixed_rule_sources.sources["img-small"])))
    assert large  # the loader decoded them above, each by img-large's own limit
    with pytest.raises(ImageTooLargeError, match=f"over the dataset's limit of {SMALL_IMAGE_LIMIT} pixels"):
        collate_bins(large[:1], small_rule)


def _manifests(
    mix: MixedRuleSources, **edits: Callable[[dict[str, Any]], None]
) -> tuple[list[str], list[Manifest]]:
    """The sources' names and loader manifests, each after `edits[name]` changed its manifest.json."""
    names, out = [], []
    for name, path in mix.sources.items():
        raw = json.loads((path / "manifest.json").read_text())
        edits.get(name.replace("-", "_"), lambda r: None)(raw)
        names.append(name)
        out.append(Manifest.from_dict(raw))
    return names, out


def _set(*keys: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        node = raw
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value

    return edit


def _videos(style: str) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        raw["counts"]["videos"] = 1
        raw["video_rule"] = VideoTokenRule(style=style, min_pixels=784, max_pixels=3136).to_dict()

    return edit


def test_what_must_agree_and_what_need_not(mixed_rule_sources: MixedRuleSources) -> None:
    names, manifests = _manifests(mixed_rule_sources)
    # text at patch 16 (no images), image budgets 1568 and 12544: they mix; the geometry is an image source's
    check_sources(names, manifests)
    assert manifests[0].image_rule.patch_size == 16 and vision_source(manifests) == 1
    assert vision_source(manifests, videos=True) == 0  # none holds videos
    refused = {
        "seq_len": dict(img_large=_set("seq_len", value=512)),
        "token ids": dict(text=_set("tokenizer", "special_ids", "image_pad", value=3)),
        "different tokenizers": dict(img_small=_set("tokenizer", "sha256", value="0" * 64)),
        "vision geometry": dict(img_large=_set("image_rule", "merge_size", value=1)),
        "image rule style": dict(img_large=_set("image_rule", "image_style", value="gemma4")),
        "pixel normalisation": dict(img_small=_set("image_rule", "image_mean", value=[0.5, 0.5, 0.5])),
        "video rule style": dict(img_small=_videos("qwen3_vl"), img_large=_videos("qwen-vl-utils")),
    }
    for what, edits in refused.items():
        with pytest.raises(ValueError, match=what) as info:
            check_sources(*_manifests(mixed_rule_sources, **edits))
        message = str(info.value)
        assert message.count("'") >= 4 and "repack" in message, message  # both sources, what to do
    # the text source holding images after all: its patch 16 is then a conflict, named with an image source's
    holds = _set("counts", "image_tokens", value=5)
    geometry = r"'text' and 'img-small' differ in vision geometry .* \(\(16, 2, 2\) vs"
    with pytest.raises(ValueError, match=geometry):
        check_sources(*_manifests(mixed_rule_sources, text=holds))
    # a video style shared by the sources holding videos, and other pixel limits and resampling, mix
    same = _manifests(mixed_rule_sources, img_small=_videos("qwen3_vl"), img_large=_videos("qwen3_vl"))
    check_sources(*same)
    assert vision_source(same[1], videos=True) == 1
    resample, limit = _set("image_rule", "resample", value=2), _set("image_rule", "max_image_pixels", value=9)
    check_sources(*_manifests(mixed_rule_sources, img_large=resample, img_small=limit))


def test_stats_of_a_mixture_refuse_what_the_loader_refuses(
    mixed_rule_sources: MixedRuleSources, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mmpack.cli import main

    spec = " ".join(f"{w} {p}" for w, p in mixed_rule_sources.pairs())
    assert main(["stats", "--mixture", spec, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for source, path in zip(report["sources"], mixed_rule_sources.sources.values()):
        counted = json.loads((path / "manifest.json").read_text())["counts"]["image_tokens"]
        assert sum(s["image_tokens"] for s in source["report"]["dataset"]["shards"]) == counted
    merged = tmp_path / "merge1"  # img-large with another merge size: not one vision tower's
    shutil.copytree(mixed_rule_sources.sources["img-large"], merged)
    raw = json.loads((merged / "manifest.json").read_text())
    raw["image_rule"]["merge_size"] = 1
    (merged / "manifest.json").write_text(json.dumps(raw))
    assert main(["stats", "--mixture", f"{spec} 1 {merged}"]) == 1
    err = capsys.readouterr().err
    assert "mixture sources 'img-small' and 'merge1' differ in vision geometry" in err, err
