"""The one manifest model (mmpack.packing.manifest): bytes, version rule, shard paths, and what the loader enforces.

`MANIFEST_V1` is the manifest.json that mmpack wrote for the fixed job below before the model existed
(format version 1). Version 2 adds `counts.truncated` and `image_rule.max_image_pixels`; version 3 adds
`video_rule`, `counts.videos`, `counts.video_tokens` and the video pad among the tokenizer's special ids;
everything else of the same job must stay byte-identical, shards included (their sha256 are in the manifest:
a dataset without videos gets no video columns or members).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmpack.dataloader import load_manifest
from mmpack.dataloader.collate import CollateConfig, ImageTooLargeError, collate_bins
from mmpack.offline_packing.finalize import _version
from mmpack.offline_packing.options import job_config
from mmpack.offline_packing.pipeline import read_manifest, run_pack
from mmpack.packing.format import DEFAULT_MAX_IMAGE_PIXELS, FORMAT_VERSION
from mmpack.packing.image_tokens import ImageTokenRule
from mmpack.packing.manifest import Manifest, ManifestError, ManifestImageRule, check_shard_path
from mmpack.packing.tokenizer import BYTE_TOKENIZER

RED_56 = "iVBORw0KGgoAAAANSUhEUgAAADgAAAA4CAIAAAAn5KxJAAAAWUlEQVR4nO3OUQkAIQBAMTWI/aMYywr38UAOtgSbZ+/xB+t14CvRmmhNtCZaE62J1kRrojXRmmhNtCZaE62J1kRrojXRmmhNtCZaE62J1kRrojXRmmhNtHYByF0BdOurBQ4AAAAASUVORK5CYII="
GREEN_84x56 = "iVBORw0KGgoAAAANSUhEUgAAAFQAAAA4CAIAAADsP0i3AAAAXElEQVR4nO3PQQEAEADAQGSQTjpRxfC4XYJt7nuGav0O+Kl5VfOq5lXNq5pXNa9qXtW8qnlV86rmVc2rmlc1r2pe1byqeVXzquZVzauaVzWval7VvKp5VfOq5lUPsyABfl6UA8QAAAAASUVORK5CYII="

MANIFEST_V1 = '{\n "algorithm": {\n  "max_images_per_bin": null,\n  "max_items_per_bin": null,\n  "name": "patterns",\n  "requested": "auto"\n },\n "chat_template": {\n  "default_system": null,\n  "name": "qwen"\n },\n "counts": {\n  "bins": 3,\n  "image_tokens": 14,\n  "rejected_by_reason": {\n   "malformed_json": 1,\n   "overlength": 1\n  },\n  "samples_packed": 6,\n  "samples_read": 8,\n  "samples_rejected": 2,\n  "tokens": 270\n },\n "created_by": "mmpack 0.1.0",\n "format": "mmpack-packed",\n "formats": [\n  "arrow",\n  "wds"\n ],\n "image_rule": {\n  "max_pixels": 12845056,\n  "merge_size": 2,\n  "min_pixels": 3136,\n  "patch_size": 14\n },\n "overlength": "drop",\n "seed": 0,\n "seq_len": 96,\n "shards": [\n  {\n   "bins": 2,\n   "bytes": 4122,\n   "first_bin": 0,\n   "format": "arrow",\n   "path": "shards/packed-000000.arrow",\n   "samples": 4,\n   "sha256": "2ce703bd879b1f3fc057e7996d4e40e90d748cc9d161b76f389ab9f4ec69ab72",\n   "tokens": 175\n  },\n  {\n   "bins": 1,\n   "bytes": 3450,\n   "first_bin": 2,\n   "format": "arrow",\n   "path": "shards/packed-000001.arrow",\n   "samples": 2,\n   "sha256": "d75747823691f089e45ab29812b76bbc0c3294304851ae9f3acd7e7092550ffa",\n   "tokens": 95\n  },\n  {\n   "bins": 2,\n   "bytes": 20480,\n   "first_bin": 0,\n   "format": "wds",\n   "path": "shards/packed-000000.tar",\n   "samples": 4,\n   "sha256": "bb9c24db613329865aab558c78b059b1c830bead586597da19eb8b884dd05cfb",\n   "tokens": 175\n  },\n  {\n   "bins": 1,\n   "bytes": 10240,\n   "first_bin": 2,\n   "format": "wds",\n   "path": "shards/packed-000001.tar",\n   "samples": 2,\n   "sha256": "bfe79a97b97af6cd3f15097db04a5008d77ec116815709774193f8d36526ea37",\n   "tokens": 95\n  }\n ],\n "tokenizer": {\n  "is_fallback": true,\n  "name": "byte-fallback",\n  "sha256": "",\n  "special_ids": {\n   "im_end": 258,\n   "im_start": 257,\n   "image_pad": 261,\n   "pad": 256,\n   "vision_end": 260,\n   "vision_start": 259\n  },\n  "vocab_size": 262\n },\n "version": 1\n}\n'
MANIFEST_V1_SHA256 = "d0b46f0e056782796b9895a37741f344bc0198071874205ce88fbbd6632b1ae8"


def write_fixed_inputs(root: Path) -> Path:
    """Eight records (LLaVA, ShareGPT, caption, text-only; one malformed, one over-length) and two PNGs."""
    (root / "imgs").mkdir(parents=True)
    (root / "imgs" / "red.png").write_bytes(base64.b64decode(RED_56))
    (root / "imgs" / "green.png").write_bytes(base64.b64decode(GREEN_84x56))
    lines: list[str] = []

    def llava(q: str, a: str, image: str | None = None) -> str:
        turns = [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        rec: dict = {"id": f"s{len(lines)}", "conversations": turns}
        if image:
            rec["image"] = image
        return json.dumps(rec)

    lines.append(llava("<image>\nWhat colour?", "Red.", "imgs/red.png"))
    lines.append(llava("Say hi.", "Hi there, friend."))
    lines.append('{"conversations": [')  # malformed: one reject
    messages = [
        {"role": "user", "content": "<image>Describe."},
        {"role": "assistant", "content": "A green box."},
    ]
    lines.append(json.dumps({"id": "sg3", "messages": messages, "images": ["imgs/green.png"]}))
    lines.append(json.dumps({"id": "cap4", "image": "imgs/red.png", "caption": "a red square"}))
    lines.append(llava("Count to three.", "One, two, three."))
    lines.append(llava("x" * 300, "too long for the bin"))  # over-length: dropped
    lines.append(llava("Name a fruit.", "Apple."))
    path = root / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_fixed_job(root: Path) -> Path:
    inp = write_fixed_inputs(root)
    out = root / "out"
    cfg = job_config(
        inputs=(str(inp),),
        output=str(out),
        seq_len=96,
        tokenizer=BYTE_TOKENIZER,
        format="both",
        max_bins_per_shard=2,
        progress=False,
    )
    run_pack(cfg)
    return out


@pytest.fixture(scope="module")
def fixed_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_fixed_job(tmp_path_factory.mktemp("fixed"))


VIDEO_RULE_V3 = """ "video_rule": {
  "fps": 2.0,
  "frame_factor": 2,
  "max_aspect_ratio": 200,
  "max_frames": 768,
  "max_pixels": 602112,
  "merge_size": 2,
  "min_frames": 4,
  "min_pixels": 100352,
  "patch_size": 14,
  "temporal_patch_size": 2,
  "total_pixels": 90316800.0
 }
"""


def expected_v3_bytes() -> bytes:
    """MANIFEST_V1 with the documented version-2 and -3 changes, edited as text (no serialiser involved)."""
    text = MANIFEST_V1.replace(' "created_by": "mmpack 0.1.0",', f' "created_by": "mmpack {_version()}",')
    counts_v3 = '  "tokens": 270,\n  "truncated": 0,\n  "video_tokens": 0,\n  "videos": 0\n },'
    text = text.replace('  "tokens": 270\n },', counts_v3)
    text = text.replace(
        '  "max_pixels": 12845056,', '  "max_image_pixels": 40000000,\n  "max_pixels": 12845056,'
    )
    text = text.replace('   "pad": 256,\n', '   "pad": 256,\n   "video_pad": 262,\n')
    text = text.replace('  "vocab_size": 262\n', '  "vocab_size": 263\n')  # the byte fallback's video pad
    return text.replace(' "version": 1\n}\n', f' "version": {FORMAT_VERSION},\n{VIDEO_RULE_V3}}}\n').encode()


def test_expected_bytes_are_the_recorded_ones() -> None:
    assert hashlib.sha256(MANIFEST_V1.encode()).hexdigest() == MANIFEST_V1_SHA256


def test_fixed_job_manifest_is_byte_identical(fixed_dataset: Path) -> None:
    got = (fixed_dataset / "manifest.json").read_bytes()
    want = expected_v3_bytes()
    assert FORMAT_VERSION == 3 and want != MANIFEST_V1.encode()  # control: the edits did change the text
    assert got.decode() == want.decode()


def test_a_version_1_manifest_round_trips_byte_for_byte() -> None:
    m = Manifest.from_json(MANIFEST_V1.encode())
    assert m.version == 1 and m.counts is not None and m.counts.truncated is None
    assert m.image_rule is not None and m.image_rule.image_pixel_limit == DEFAULT_MAX_IMAGE_PIXELS
    assert m.to_json() == MANIFEST_V1.encode()
    assert Manifest.from_dict(m.to_dict()) == m


def test_a_version_2_manifest_loads_without_videos(fixed_dataset: Path) -> None:
    """A version 2 dataset (no video fields anywhere) reads as before: no video rule, no video counts."""
    text = MANIFEST_V1.replace('  "tokens": 270\n },', '  "tokens": 270,\n  "truncated": 0\n },')
    text = text.replace(' "version": 1\n', ' "version": 2\n')
    m = Manifest.from_json(text.encode())
    assert m.version == 2 and m.video_rule is None and m.counts is not None and m.counts.videos is None
    assert m.to_json() == text.encode()
    # the shards of an image-only job have no video columns or members: their records read with no videos
    v2 = fixed_dataset.parent / "as_v2"
    if not v2.exists():
        shutil.copytree(fixed_dataset, v2)
    raw = json.loads((v2 / "manifest.json").read_bytes())
    raw["version"] = 2
    del raw["video_rule"], raw["counts"]["videos"], raw["counts"]["video_tokens"]
    (v2 / "manifest.json").write_text(json.dumps(raw))
    loaded = load_manifest(str(v2))
    assert loaded.video_pad_id == 262 and loaded.num_bins == 3
    from mmpack.dataloader.readers import ArrowShardReader, WdsShardReader

    for entry in raw["shards"]:
        path = str(v2 / entry["path"])
        reader = (
            ArrowShardReader(path, label=path)
            if entry["format"] == "arrow"
            else WdsShardReader(path, label=path)
        )
        for i in range(len(reader)):
            rec = reader.read(i)
            assert rec["videos"] == [] and rec["video_plans"] == [] and rec["video_grid_thw"].shape == (0, 3)
        reader.close()


def test_unknown_keys_are_kept() -> None:
    raw = json.loads(MANIFEST_V1) | {"note": {"made": "by hand"}}
    assert Manifest.from_dict(raw).to_dict() == raw


def test_a_newer_version_is_refused_with_upgrade_advice() -> None:
    raw = json.loads(MANIFEST_V1) | {"version": FORMAT_VERSION + 1}
    with pytest.raises(ManifestError, match=r"version 4 is newer .*upgrade mmpack"):
        Manifest.from_dict(raw, source="ds/manifest.json")


@pytest.mark.parametrize("version", [0, -1, "2", None, True])
def test_a_bad_version_is_refused(version: object) -> None:
    with pytest.raises(ManifestError, match="version"):
        Manifest.from_dict(json.loads(MANIFEST_V1) | {"version": version})


ESCAPING_PATHS = [
    "../elsewhere/x.arrow",
    "../../etc/passwd",
    "shards/../../x.arrow",
    "/etc/passwd",
    "s3://bucket/x.arrow",
    "file:///etc/passwd",
    "C:\\x.arrow",
    "shards//x.arrow",
    "./shards/x.arrow",
    "",
]


@pytest.mark.parametrize("path", ESCAPING_PATHS)
def test_shard_paths_must_stay_inside_the_root(path: str) -> None:
    raw = json.loads(MANIFEST_V1)
    raw["shards"][1]["path"] = path
    with pytest.raises(ManifestError, match=r"shards\[1\]"):
        Manifest.from_dict(raw, source="ds/manifest.json")
    assert check_shard_path("shards/packed-000000.arrow", "x") == "shards/packed-000000.arrow"  # control


@pytest.mark.parametrize(
    "path", ["../elsewhere/x.arrow", "../../etc/passwd", "/etc/passwd", "s3://bucket/x.arrow"]
)
def test_loader_refuses_a_shard_path_leaving_the_root(fixed_dataset: Path, tmp_path: Path, path: str) -> None:
    copy = tmp_path / "ds"
    copy.mkdir()
    assert load_manifest(str(fixed_dataset)).num_bins == 3  # control: the untouched dataset loads
    raw = json.loads((fixed_dataset / "manifest.json").read_bytes())
    raw["shards"][0]["path"] = path
    (copy / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError) as info:
        load_manifest(str(copy))
    message = str(info.value)
    assert "shards[0]" in message and repr(path) in message and str(copy) in message


def test_read_manifest_goes_through_the_model(fixed_dataset: Path, tmp_path: Path) -> None:
    assert read_manifest(str(fixed_dataset)) == json.loads((fixed_dataset / "manifest.json").read_bytes())
    raw = json.loads((fixed_dataset / "manifest.json").read_bytes()) | {"version": 99}
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="upgrade mmpack"):
        read_manifest(str(tmp_path))


def test_counts_and_image_rule_records() -> None:
    raw = json.loads(MANIFEST_V1)
    raw["counts"]["truncated"] = 2
    raw["image_rule"]["max_image_pixels"] = 1000
    m = Manifest.from_dict(raw)
    assert m.counts is not None and m.counts.truncated == 2
    assert m.image_rule == ManifestImageRule(max_image_pixels=1000) and m.image_rule.image_pixel_limit == 1000
    raw["counts"]["truncated"] = -1
    with pytest.raises(ManifestError, match=r"counts\.truncated"):
        Manifest.from_dict(raw)


def test_shards_of_each_format_must_hold_consecutive_bins() -> None:
    raw = json.loads(MANIFEST_V1)
    raw["shards"][1]["first_bin"] = 3
    with pytest.raises(ManifestError, match="starts at bin 3, expected 2"):
        Manifest.from_dict(raw)


# -- the loader's image limit ------------------------------------------------------------------------------


def png_bytes(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def one_image_bin(data: bytes, rule: ImageTokenRule, width: int, height: int) -> dict:
    grid = np.array([[1, height // rule.patch_size, width // rule.patch_size]], dtype=np.int32)
    pads = rule.tokens_of_grid(tuple(grid[0]))
    ids = np.array([1] + [9] * pads + [2], dtype=np.uint32)
    return {
        "key": "t-000000007",
        "input_ids": ids,
        "loss_mask": np.zeros(ids.size, np.uint8),
        "seq_lens": np.array([ids.size], np.int32),
        "sample_ids": ["a"],
        "images": [data],
        "image_formats": ["png"],
        "image_grid_thw": grid,
    }


def test_loader_refuses_an_image_over_the_manifest_limit_before_decoding() -> None:
    rule = ImageTokenRule()
    record = one_image_bin(png_bytes(56, 84), rule, 56, 84)

    def config(limit: int) -> CollateConfig:
        return CollateConfig(seq_len=64, pad_id=0, image_pad_id=9, rule=rule, max_image_pixels=limit)

    assert collate_bins([record], config(56 * 84)).pixel_values.shape[0] == 6 * 4  # control: at the limit
    with pytest.raises(ImageTooLargeError, match=r"bin t-000000007 image 0 is 56x84 .*4703 pixels"):
        collate_bins([record], config(56 * 84 - 1))


def test_loader_limit_comes_from_the_manifest(fixed_dataset: Path, tmp_path: Path) -> None:
    assert (
        load_manifest(str(fixed_dataset)).max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS
    )  # recorded by the job
    raw = json.loads(MANIFEST_V1)
    raw["image_rule"]["max_image_pixels"] = 1234
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    assert load_manifest(str(tmp_path)).max_image_pixels == 1234
    del raw["image_rule"]["max_image_pixels"]
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    assert load_manifest(str(tmp_path)).max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS == 40_000_000


def test_image_rule_keeps_the_pixel_options_of_the_rule() -> None:
    raw = json.loads(MANIFEST_V1)
    raw["image_rule"]["image_mean"] = [0.5, 0.5, 0.5]
    m = Manifest.from_dict(raw)
    assert m.image_rule is not None and m.image_rule.token_rule().image_mean == (0.5, 0.5, 0.5)
    assert m.to_dict() == raw
    rule = ImageTokenRule(image_std=(0.25, 0.25, 0.25))
    entry = ManifestImageRule.from_rule(rule, 100)
    assert entry.pixel_options == {"image_std": [0.25, 0.25, 0.25]} and entry.token_rule() == rule
    assert (
        ManifestImageRule.from_rule(ImageTokenRule(), None).to_dict() == json.loads(MANIFEST_V1)["image_rule"]
    )
    raw["image_rule"]["colour"] = "blue"
    with pytest.raises(ManifestError, match=r"image_rule: unknown keys \['colour'\]"):
        Manifest.from_dict(raw)


def test_loader_names_shard_bin_and_image_of_a_too_large_image(fixed_dataset: Path, tmp_path: Path) -> None:
    import shutil

    from mmpack.dataloader import Topology, build_loader

    def first_batches(root: Path) -> list:
        loader = build_loader(
            str(root),
            topology=Topology(dp_rank=0, dp_size=1),
            micro_batch_size=1,
            global_batch_size=1,
            num_workers=0,
            num_epochs=1,
        )
        return list(loader)

    copy = tmp_path / "ds"
    shutil.copytree(fixed_dataset, copy, ignore=shutil.ignore_patterns("_work"))
    assert len(first_batches(copy)) == 3  # control: the limit recorded by the job lets every image through
    raw = json.loads((copy / "manifest.json").read_bytes())
    raw["image_rule"]["max_image_pixels"] = 56 * 56 - 1  # below the smallest image of the dataset
    (copy / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(
        Exception, match=r"shard shards/packed-00000\d\.arrow: bin packed-\d+ image 0 is \d+x56"
    ):
        first_batches(copy)
