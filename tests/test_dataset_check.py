"""`mmpack.trainer.dataset_check`: a dataset whose image rule or tokenizer disagrees with the model folder is refused."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import transformers
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mmpack.packing.image_tokens import ImageTokenRule
from mmpack.packing.manifest import ManifestImageRule
from mmpack.packing.tokenizer import BYTE_TOKENIZER, load_tokenizer, tokenizer_info
from mmpack.trainer.dataset_check import DatasetModelMismatch, check_dataset_matches_model
from tests.support.fixtures_data import train_tiny_bpe

MODEL_RULE = ImageTokenRule(max_pixels=50176)


def write_model_folder(
    folder: Path, tokenizer_file: Path | None, *, preprocessor: bool = True, vision: dict | None = None
) -> Path:
    """config.json of a tiny Qwen2.5-VL (ids taken from the tokenizer), preprocessor and tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = load_tokenizer(tokenizer_file).special_ids if tokenizer_file else {}
    config = transformers.Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 151936,
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "out_hidden_size": 32,
            "num_heads": 2,
            **(vision or {}),
        },
        image_token_id=ids.get("image_pad", 151655),
        vision_start_token_id=ids.get("vision_start", 151652),
        vision_end_token_id=ids.get("vision_end", 151653),
    )
    config.save_pretrained(str(folder))
    if preprocessor:
        Qwen2VLImageProcessorPil(
            min_pixels=MODEL_RULE.min_pixels, max_pixels=MODEL_RULE.max_pixels
        ).save_pretrained(str(folder))
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, folder / "tokenizer.json")
    return folder


def manifest_for(tokenizer_file: Path | None, rule: ImageTokenRule) -> dict[str, Any]:
    """The tokenizer and image_rule entries as `mmpack pack` writes them."""
    return {
        "tokenizer": tokenizer_info(load_tokenizer(tokenizer_file or BYTE_TOKENIZER)),
        "image_rule": ManifestImageRule.from_rule(rule, None).to_dict(),
    }


@pytest.fixture
def bpe(tmp_path: Path) -> Path:
    return train_tiny_bpe(tmp_path / "bpe")


def test_matching_dataset_passes_and_says_what_it_checked(tmp_path: Path, bpe: Path) -> None:
    model = write_model_folder(tmp_path / "model", bpe)
    checked = check_dataset_matches_model(manifest_for(bpe, MODEL_RULE), model)
    text = "\n".join(checked)
    for what in (
        "preprocessor_config.json",
        "tokenizer.json",
        "vision_config",
        "image_token_id",
        "vocab_size",
    ):
        assert what in text


@pytest.mark.parametrize(
    ("rule", "field", "dataset_value", "model_value"),
    [
        (
            ImageTokenRule(max_pixels=50176, image_mean=(0.5, 0.5, 0.5)),
            "image_mean",
            "[0.5, 0.5, 0.5]",
            "0.4814",
        ),
        (ImageTokenRule(max_pixels=50176, resample=2), "resample", "2", "3"),
        (ImageTokenRule(max_pixels=50176, temporal_patch_size=1), "temporal_patch_size", "1", "2"),
    ],
)
def test_image_rule_disagreement_names_both_values(
    tmp_path: Path, bpe: Path, rule: ImageTokenRule, field: str, dataset_value: str, model_value: str
) -> None:
    model = write_model_folder(tmp_path / "model", bpe)
    with pytest.raises(DatasetModelMismatch, match=rf"image_rule\.{field}") as info:
        check_dataset_matches_model(manifest_for(bpe, rule), model, dataset="/data/packed")
    message = str(info.value)
    assert f"dataset {dataset_value}" in message and model_value in message
    assert (
        "preprocessor_config.json" in message
        and "/data/packed" in message
        and "mmpack pack --model" in message
    )


def test_pixel_budget_is_the_dataset_own_and_a_text_dataset_has_no_image_rule(
    tmp_path: Path, bpe: Path
) -> None:
    """Another min/max pixels than the processor's is noted, not refused (the tower takes any grid); a dataset
    holding no images or videos is not checked against the vision config or the processor at all."""
    model = write_model_folder(tmp_path / "model", bpe)
    budget = ImageTokenRule(min_pixels=6272, max_pixels=12845056)
    checked = "\n".join(check_dataset_matches_model(manifest_for(bpe, budget), model))
    assert "image_rule.max_pixels: dataset 12845056 (manifest.json), model 50176" in checked
    assert "image_rule.min_pixels: dataset 6272" in checked and "own pixel budget" in checked
    text = manifest_for(bpe, ImageTokenRule(patch_size=16, image_mean=(0.5, 0.5, 0.5)))
    with pytest.raises(DatasetModelMismatch, match=r"patch_size: dataset 16 .* model 14"):  # control
        check_dataset_matches_model(text, model)
    text["counts"] = {**COUNTS, "image_tokens": 0}
    assert "image rule: none held, none checked" in check_dataset_matches_model(text, model)
    text["counts"]["videos"] = 1  # a video is cut by the image rule's patches too
    with pytest.raises(DatasetModelMismatch, match="patch_size"):
        check_dataset_matches_model(text, model)


COUNTS = {
    "samples_read": 1, "samples_packed": 1, "samples_rejected": 0, "rejected_by_reason": {}, "bins": 1,
    "tokens": 10,
}  # fmt: skip


def test_vision_config_checked_without_preprocessor(tmp_path: Path, bpe: Path) -> None:
    model = write_model_folder(tmp_path / "model", bpe, preprocessor=False, vision={"patch_size": 16})
    # no preprocessor_config.json: min/max pixels are not settled by the folder, patch size is (config.json)
    with pytest.raises(DatasetModelMismatch, match=r"image_rule.patch_size: dataset 14 .* model 16"):
        check_dataset_matches_model(manifest_for(bpe, ImageTokenRule(max_pixels=50176)), model)
    model16 = write_model_folder(tmp_path / "model16", bpe, preprocessor=False)
    checked = check_dataset_matches_model(manifest_for(bpe, ImageTokenRule(max_pixels=1234567)), model16)
    assert not any("preprocessor_config" in c for c in checked)


def test_other_tokenizer_is_refused(tmp_path: Path, bpe: Path) -> None:
    other = train_tiny_bpe(tmp_path / "other", vocab_size=700)
    model = write_model_folder(tmp_path / "model", bpe)
    with pytest.raises(DatasetModelMismatch, match=r"tokenizer\.sha256") as info:
        check_dataset_matches_model(manifest_for(other, MODEL_RULE), model)
    assert load_tokenizer(other).sha256 in str(info.value) and load_tokenizer(bpe).sha256 in str(info.value)
    with pytest.raises(DatasetModelMismatch, match="byte-level demo fallback"):
        check_dataset_matches_model(manifest_for(None, MODEL_RULE), model)


def test_special_ids_checked_against_config_json(tmp_path: Path, bpe: Path) -> None:
    model = write_model_folder(tmp_path / "model", None)  # config.json only: Qwen ids 151652..151655
    manifest = manifest_for(bpe, MODEL_RULE)
    with pytest.raises(DatasetModelMismatch, match=r"special_ids\.image_pad") as info:
        check_dataset_matches_model(manifest, model)
    assert "image_token_id=151655" in str(info.value)
    manifest["tokenizer"]["special_ids"].update(image_pad=151655, vision_start=151652, vision_end=151653)
    manifest["tokenizer"]["vocab_size"] = 200_000
    with pytest.raises(DatasetModelMismatch, match="vocab_size") as info:
        check_dataset_matches_model(manifest, model)
    assert "tokenizer.special_ids" not in str(info.value)


@pytest.mark.shared
def test_qwen3_tokenizer_folder(tmp_path: Path, qwen3_tokenizer_path: Path) -> None:
    model = write_model_folder(tmp_path / "model", qwen3_tokenizer_path)
    assert check_dataset_matches_model(manifest_for(qwen3_tokenizer_path, MODEL_RULE), model)
    with pytest.raises(DatasetModelMismatch, match="image_mean"):
        rule = ImageTokenRule(max_pixels=50176, image_mean=(0.5, 0.5, 0.5))
        check_dataset_matches_model(manifest_for(qwen3_tokenizer_path, rule), model)


def test_gemma4_folder_image_style_and_processor_config(tmp_path: Path, bpe: Path) -> None:
    """A Gemma 4 folder (its image processor in transformers 5's processor_config.json, a tokenizer with Gemma 4's
    control tokens and none of Qwen's): a dataset packed by its rules passes, the model's tokenizer read for those
    tokens and the messages naming processor_config.json; the same numbers under Qwen2-VL's resize are refused
    naming image_rule.image_style (control)."""
    from mmpack.packing.image_tokens_gemma4 import CONTROL_TOKENS
    from mmpack.packing.tokenizer import QWEN_TOKENS
    from tests.support.gemma4 import edit_added_tokens

    model = tmp_path / "model"
    file = edit_added_tokens(bpe, model, drop=QWEN_TOKENS.literals, add=CONTROL_TOKENS.literals)
    tokenizer = tokenizer_info(load_tokenizer(file, CONTROL_TOKENS))
    ids = tokenizer["special_ids"]
    image = {"image_processor_type": "Gemma4ImageProcessor", "max_soft_tokens": 70}
    (model / "processor_config.json").write_text(json.dumps({"image_processor": image}))
    config = {
        "model_type": "gemma4", "image_token_id": ids["image_pad"], "boi_token_id": ids["image_start"],
        "eoi_token_id": ids["image_end"], "vision_config": {"patch_size": 16, "pooling_kernel_size": 3},
    }  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    rule = ImageTokenRule.from_preprocessor_config(image)
    manifest = {"tokenizer": tokenizer, "image_rule": ManifestImageRule.from_rule(rule, None).to_dict()}
    checked = "\n".join(check_dataset_matches_model(manifest, model))
    assert "processor_config.json image_processor" in checked and "preprocessor_config" not in checked
    assert "boi_token_id" in checked and f"tokenizer vs {file}" in checked
    qwen = dataclasses.replace(rule, image_style="qwen2_vl")
    manifest["image_rule"] = ManifestImageRule.from_rule(qwen, None).to_dict()
    with pytest.raises(DatasetModelMismatch) as info:
        check_dataset_matches_model(manifest, model)
    where = f"{model / 'processor_config.json'} image_processor"
    line = f"image_rule.image_style: dataset qwen2_vl (manifest.json), model gemma4 ({where})"
    assert line in str(info.value), info.value


def test_not_a_model_folder(tmp_path: Path, bpe: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        check_dataset_matches_model(manifest_for(bpe, MODEL_RULE), tmp_path)
    with pytest.raises(TypeError, match="manifest"):
        check_dataset_matches_model(42, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    assert check_dataset_matches_model(manifest_for(bpe, MODEL_RULE), tmp_path) == []
