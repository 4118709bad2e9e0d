"""`mmpack convert`: HF -> megatron-core (TP x PP rank files) -> HF is bit-exact, with tied embeddings (the
output layer on another stage) and untied; the export loads in transformers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.qwen2_5_vl import hf_model_for
from tests.support.ranks import warm_start_method

pytestmark = pytest.mark.slow


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _assert_bit_exact(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].equal(b[name]), name


@pytest.mark.ranks
@pytest.mark.parametrize(("tp", "pp", "tied"), [(2, 2, True), (2, 1, False)])
def test_round_trip_bit_exact_and_export_loads(tmp_path: Path, tp: int, pp: int, tied: bool) -> None:
    """HF -> megatron-core rank files -> HF gives the same bytes; the export loads in transformers and gives
    the original model's loss on the packed samples (whose equality with the trainer's logged loss is
    tests/test_trainer_hf_parity.py)."""
    from mmpack.trainer.convert import hf_to_mcore, mcore_to_hf
    from tests.support.qwen2_5_vl import reference
    from tests.support.trainer import make_packed_dataset

    packed = make_packed_dataset(tmp_path / "data", n_samples=5, seed=7, seq_len=1024)
    assert json.loads((packed / "manifest.json").read_text())["counts"]["bins"] == 1
    hf_dir = hf_model_for(packed, tmp_path / "hf", tied=tied)
    ckpt = tmp_path / "mcore"
    assert (
        hf_to_mcore(str(hf_dir), str(ckpt), tp=tp, pp=pp, start_method=warm_start_method()) / "metadata.json"
    ).is_file()
    mcore_to_hf(str(ckpt), str(tmp_path / "back"), start_method=warm_start_method())
    _assert_bit_exact(_tensors(hf_dir), _tensors(tmp_path / "back"))

    max_pixels = json.loads((packed / "manifest.json").read_text())["image_rule"]["max_pixels"]
    original = reference(hf_dir, packed, max_pixels=max_pixels)
    exported = reference(tmp_path / "back", packed, max_pixels=max_pixels)
    assert exported["loss"] == original["loss"]


@pytest.mark.ranks
def test_converted_checkpoint_trains_like_hf_model_and_trained_one_exports(
    tmp_path: Path, packed_dataset: Callable[..., Path]
) -> None:
    """Converted at TP2 x PP2, loaded at TP2 x PP1 (dist_checkpointing reshards): the same logged loss as
    `--hf-model`; the trainer's own checkpoint (optimizer and all, lr 0) exports to the original weights."""
    from mmpack.trainer.convert import hf_to_mcore, mcore_to_hf
    from tests.support.hf_parity import torchrun

    packed = packed_dataset(n_samples=40, seed=8, seq_len=256)
    hf_dir = hf_model_for(packed, tmp_path / "hf", tied=False)
    hf_to_mcore(str(hf_dir), str(tmp_path / "mcore"), tp=2, pp=2, start_method=warm_start_method())
    common = [
        "--data-path", str(packed), "--tensor-model-parallel-size", "2", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "1", "--lr", "0", "--num-workers", "0",
    ]  # fmt: skip
    losses = {}
    for name, extra in {
        "hf": ["--hf-model", str(hf_dir), "--save", str(tmp_path / "trained")],
        "converted": ["--load", str(tmp_path / "mcore"), "--finetune"],
    }.items():
        metrics = tmp_path / f"{name}.jsonl"
        torchrun(
            2,
            ["-m", "mmpack.trainer.pretrain_vlm", *common, *extra, "--metrics-file", str(metrics)],
            tmp_path,
        )
        losses[name] = json.loads(metrics.read_text().splitlines()[0])["loss"]
    assert losses["converted"] == losses["hf"]
    mcore_to_hf(str(tmp_path / "trained"), str(tmp_path / "export"), start_method=warm_start_method())
    _assert_bit_exact(_tensors(hf_dir), _tensors(tmp_path / "export"))


def test_bad_inputs_fail_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mmpack.cli import main as mmpack

    assert mmpack(["convert", "hf-to-mcore", "--hf", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert mmpack(["convert", "mcore-to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "mmpack convert: error:" in capsys.readouterr().err
