"""`mmpack pack --model DIR` (and `-t DIR`): tokenizer and image rule from an HF model folder, recorded in the
manifest; the loader's pixels then equal the folder's own `Qwen2VLImageProcessorPil`, and the trainer's check
accepts the dataset for that folder and refuses one packed with another rule."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

from mmpack.cli import main as mmpack
from mmpack.dataloader import Topology, build_loader, load_manifest
from mmpack.offline_packing.config import PackJobConfig
from mmpack.offline_packing.flags import config_from_args
from mmpack.offline_packing.model_folder import resolve_image_rule
from mmpack.packing.image_tokens import CLIP_MEAN, ImageTokenRule, load_model_image_rule
from mmpack.packing.tokenizer import load_tokenizer
from mmpack.trainer.dataset_check import DatasetModelMismatch, check_dataset_matches_model
from tests.support.fixtures_data import train_tiny_bpe
from tests.support.loader_data import all_records


def model_folder(folder: Path, tokenizer_file: Path | None, **processor: object) -> Path:
    """preprocessor_config.json as transformers 5 writes it, tokenizer.json, and a tiny Qwen2.5-VL config.json."""
    from transformers import Qwen2_5_VLConfig

    folder.mkdir(parents=True, exist_ok=True)
    pil.Qwen2VLImageProcessorPil(**processor).save_pretrained(str(folder))
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, folder / "tokenizer.json")
    Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 151936,
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        },
        vision_config={"depth": 1, "hidden_size": 16, "out_hidden_size": 32, "num_heads": 2},
    ).save_pretrained(str(folder))
    return folder


def parse(argv: list[str]) -> PackJobConfig:
    import argparse

    from mmpack.offline_packing.flags import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(["-i", "x.jsonl", "-o", "out", "-L", "64", *argv]))


def test_flags_resolve_model_folder(tmp_path: Path) -> None:
    tok = train_tiny_bpe(tmp_path / "bpe")
    model = model_folder(
        tmp_path / "model", tok, min_pixels=6272, max_pixels=50176, image_mean=[0.5, 0.5, 0.5]
    )
    for argv in (
        ["--model", str(model)],
        ["-t", str(model)],
        ["--model", str(model), "--max-pixels", "50176"],
    ):
        cfg = parse(argv)
        rule = cfg.lengths.image_rule
        assert (rule.min_pixels, rule.max_pixels, rule.image_mean) == (6272, 50176, (0.5, 0.5, 0.5))
        assert cfg.tokenizer == str(model) and rule.temporal_patch_size == 2 and rule.resample == 3
    cfg = parse(["--model", str(model), "-t", str(tok)])  # an explicit -t wins for the tokenizer only
    assert cfg.tokenizer == str(tok) and cfg.lengths.image_rule.max_pixels == 50176
    plain = parse(["-t", str(tok), "--max-pixels", "50176"]).lengths.image_rule  # a tokenizer file: the flags
    assert (plain.min_pixels, plain.max_pixels, plain.image_mean) == (3136, 50176, CLIP_MEAN)
    assert parse(["-t", str(tok)]).lengths.image_rule.max_pixels == 12845056
    with pytest.raises(ValueError, match="no tokenizer"):  # no silent default tokenizer
        parse([])


def test_flags_contradicting_the_model_folder_are_errors(tmp_path: Path) -> None:
    tok = train_tiny_bpe(tmp_path / "bpe")
    model = model_folder(tmp_path / "model", tok, max_pixels=50176)
    # the pixel budget is the dataset's own (the vision tower takes any grid); a budget that is none is refused
    budget = parse(["--model", str(model), "--max-pixels", "1000000"]).lengths.image_rule
    assert budget == dataclasses.replace(load_model_image_rule(model), max_pixels=1000000)
    with pytest.raises(
        ValueError, match=r"--max-pixels over .*preprocessor_config\.json: need 0 < min_pixels"
    ):
        parse(["--model", str(model), "--max-pixels", "5"])
    with pytest.raises(ValueError, match="--patch-size 16 disagrees"):
        parse(["--model", str(model), "--patch-size", "16"])
    (model / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        parse(["--model", str(model)])
    with pytest.raises(ValueError, match=r"no preprocessor_config\.json"):
        resolve_image_rule(str(tmp_path / "bpe"), None, {})
    with pytest.raises(ValueError, match="not a folder"):
        resolve_image_rule(str(tok), None, {})
    rc = mmpack(["pack", "-i", "x.jsonl", "-o", str(tmp_path / "o"), "-L", "64", "--model", str(model), "-t", str(tok),
                 "--max-pixels", "5"])  # fmt: skip
    assert rc == 2


@pytest.mark.shared
def test_pack_with_model_folder_end_to_end(
    tmp_path: Path, mllm_demo_json: Path, qwen3_tokenizer_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_folder(tmp_path / "model", qwen3_tokenizer_path, min_pixels=3136, max_pixels=50176)
    out = tmp_path / "packed"
    args = ["pack", "-i", str(mllm_demo_json), "-o", str(out), "-L", "4096", "--no-progress"]
    assert mmpack([*args, "--model", str(model)]) == 0, capsys.readouterr().err
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["image_rule"]["max_pixels"] == 50176 and raw["image_rule"]["min_pixels"] == 3136
    assert raw["tokenizer"]["sha256"] == load_tokenizer(qwen3_tokenizer_path).sha256
    manifest = load_manifest(str(out))
    assert manifest.image_rule == ImageTokenRule(max_pixels=50176)
    assert any("preprocessor_config" in c for c in check_dataset_matches_model(manifest, model))

    # the loader's pixels equal the model folder's own processor on every image, in order
    processor = pil.Qwen2VLImageProcessorPil.from_pretrained(str(model))
    records = all_records(out)
    loader = build_loader(
        str(out), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=0, num_epochs=1,
    )  # fmt: skip
    n_images = 0
    for batch in loader:
        images = [im for b in batch.bin_ids.tolist() for im in records[b]["images"]]
        if not images:
            continue
        ref = processor(images=[Image.open(io.BytesIO(d)) for d in images], return_tensors="np")
        np.testing.assert_array_equal(batch.image_grid_thw.numpy(), ref["image_grid_thw"])
        assert float(np.abs(batch.pixel_values.numpy() - ref["pixel_values"]).max()) <= 1e-5
        assert batch.pixel_values.shape[1] == 3 * 2 * 14 * 14
        n_pads = int((batch.tokens == raw["tokenizer"]["special_ids"]["image_pad"]).sum())
        assert n_pads == int(ref["image_grid_thw"].prod(axis=1).sum()) // 4  # offline count == loader's
        n_images += len(images)
    assert n_images == sum(len(r.get("images", [])) for r in json.loads(mllm_demo_json.read_text()))

    # `-t DIR` records the same rule; a dataset packed with the default max_pixels is the model's with its own
    # pixel budget (noted), one with another patch size is refused
    assert mmpack([*args[:4], str(tmp_path / "via_t"), *args[5:], "-t", str(model)]) == 0
    assert json.loads((tmp_path / "via_t" / "manifest.json").read_text())["image_rule"] == raw["image_rule"]
    other = tmp_path / "default_rule"
    assert mmpack([*args[:4], str(other), *args[5:], "-t", str(qwen3_tokenizer_path)]) == 0
    checked = check_dataset_matches_model(load_manifest(str(other)), model, dataset=str(other))
    assert any("image_rule.max_pixels: dataset 12845056" in c and "own pixel budget" in c for c in checked)
    patch16 = tmp_path / "patch16"
    flags = ["-t", str(qwen3_tokenizer_path), "--patch-size", "16"]
    assert mmpack([*args[:4], str(patch16), *args[5:], *flags]) == 0
    with pytest.raises(DatasetModelMismatch, match=r"image_rule\.patch_size: dataset 16 .* model 14"):
        check_dataset_matches_model(load_manifest(str(patch16)), model, dataset=str(patch16))
