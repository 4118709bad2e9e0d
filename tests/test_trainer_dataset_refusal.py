"""The trainer refuses, with one error, a dataset packed with another image rule or tokenizer than
--hf-model's folder (mmpack.trainer.dataset_check wired into the Trainer); the same folder with the dataset's own
preprocessor config and tokenizer trains (control)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ranks, pytest.mark.shared, pytest.mark.slow]


def _preprocessor_config(manifest: dict, **override: object) -> dict:
    from mmpack.packing.manifest import ManifestImageRule

    rule = ManifestImageRule.from_dict(manifest["image_rule"], "manifest.json image_rule").token_rule()
    return {"image_processor_type": "Qwen2VLImageProcessor", **rule.to_dict(), **override}


def test_trainer_refuses_dataset_packed_for_another_model(tmp_path: Path, qwen3_tokenizer_path: Path) -> None:
    from tests.support.qwen2_5_vl import hf_model_for
    from tests.support.trainer import make_packed_dataset, train

    packed = make_packed_dataset(tmp_path / "data", n_samples=12, seed=3, seq_len=256)
    manifest = json.loads((packed / "manifest.json").read_text())
    hf_dir = hf_model_for(packed, tmp_path / "hf", tied=True)
    args = [
        "--hf-model", str(hf_dir), "--data-path", str(packed), "--train-iters", "1", "--lr", "0",
        "--num-workers", "0",
    ]  # fmt: skip

    # another normalisation (another pixel budget would be the dataset's own, test_dataset_check.py)
    (hf_dir / "preprocessor_config.json").write_text(
        json.dumps(_preprocessor_config(manifest, image_mean=[0.5, 0.5, 0.5]))
    )
    shutil.copy(qwen3_tokenizer_path, hf_dir / "tokenizer.json")
    run = train(1, args, tmp_path / "refused", tiny=False)
    assert run.returncode != 0 and run.metrics == []
    err = run.stderr
    assert f"pretrain_vlm: error: {packed} was not packed for the model in {hf_dir}" in err
    assert "image_rule.image_mean: dataset [0.48" in err
    assert f"model [0.5, 0.5, 0.5] ({hf_dir / 'preprocessor_config.json'})" in err
    assert "tokenizer.sha256: dataset " in err
    assert f"repack it with `mmpack pack --model {hf_dir} ...`" in err
    # one message, no traceback of the worker (torchrun adds its own report of the exit code)
    assert err.count("pretrain_vlm: error:") == 1 and "dataset_check.py" not in err

    # control: the folder's preprocessor config and tokenizer are the dataset's
    (hf_dir / "preprocessor_config.json").write_text(json.dumps(_preprocessor_config(manifest)))
    shutil.copy(packed.parent / "tokenizer" / "tokenizer.json", hf_dir / "tokenizer.json")
    run = train(1, args, tmp_path / "accepted", tiny=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.train) == 1
