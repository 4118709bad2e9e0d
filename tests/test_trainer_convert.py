"""`mmpack convert`: HF -> megatron-core (TP2 x PP2) -> HF is bit-exact; the converted checkpoint trains to the
same loss as `--hf-model`; a checkpoint saved by the trainer exports to a folder transformers loads, whose loss
on the bin equals the trainer's logged loss. Tied embeddings (the output layer on another stage)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _hf_model_for(packed: Path, out: Path, *, tied: bool) -> Path:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from trainer.models.qwen2_5_vl import tiny_hf_config

    tok = json.loads((packed / "manifest.json").read_text())["tokenizer"]
    ids = tok["special_ids"]
    config = tiny_hf_config(
        vocab_size=-(-tok["vocab_size"] // 128) * 128, image_token_id=ids["image_pad"],
        vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
        num_layers=2, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(1)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name and "ln_q" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out)
    return out


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _assert_bit_exact(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].equal(b[name]), name


def test_round_trip_bit_exact_and_trainer_export(tmp_path: Path) -> None:
    from tests.test_trainer_hf_parity import _reference, _torchrun
    from tests.test_trainer_support import make_packed_dataset
    from trainer.convert import hf_to_mcore, mcore_to_hf

    packed = make_packed_dataset(tmp_path / "data", n_samples=5, seed=7, seq_len=1024)
    assert json.loads((packed / "manifest.json").read_text())["counts"]["bins"] == 1
    hf_dir = _hf_model_for(packed, tmp_path / "hf", tied=True)
    original = _tensors(hf_dir)

    ckpt = tmp_path / "mcore"
    files = hf_to_mcore(str(hf_dir), str(ckpt), tp=2, pp=2)
    assert len(files) == 4
    mcore_to_hf(str(ckpt), str(tmp_path / "back"))
    _assert_bit_exact(original, _tensors(tmp_path / "back"))

    common = [
        "--data-path", str(packed), "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "0",
        "--num-workers", "0",
    ]  # fmt: skip
    runs = {}
    for name, extra in {
        "hf": ["--hf-model", str(hf_dir), "--save", str(tmp_path / "trained")],
        "converted": ["--load", str(ckpt)],
    }.items():
        metrics = tmp_path / f"{name}.jsonl"
        _torchrun(
            4, ["-m", "trainer.pretrain_vlm", *common, *extra, "--metrics-file", str(metrics)], tmp_path
        )
        runs[name] = json.loads(metrics.read_text().splitlines()[0])["loss"]
    assert runs["converted"] == runs["hf"]

    # the trainer's own checkpoint (optimizer, scheduler, ...) exports to the same weights (lr 0)
    export = tmp_path / "export"
    mcore_to_hf(str(tmp_path / "trained"), str(export))
    _assert_bit_exact(original, _tensors(export))
    manifest = json.loads((packed / "manifest.json").read_text())
    ref = _reference(export, packed, max_pixels=manifest["image_rule"]["max_pixels"])
    assert runs["hf"] == pytest.approx(ref["loss"], rel=1e-5)


def test_bad_inputs_fail_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from offline_packing.cli import main as mmpack

    assert mmpack(["convert", "hf-to-mcore", "--hf", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert mmpack(["convert", "mcore-to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "mmpack convert: error:" in capsys.readouterr().err
