"""mmpack.trainer.export_check: a checkpoint's logits at TP1 (megatron-core) equal transformers' on the HF folder it
came from, on a packed sample with images; a folder with one adapter weight changed is the control."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ranks import warm_start_method

pytestmark = [pytest.mark.ranks, pytest.mark.family, pytest.mark.slow]


def test_checkpoint_logits_equal_transformers(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.convert import hf_to_mcore
    from mmpack.trainer.export_check import first_image_sample, hf_logits, mcore_logits
    from tests.support.qwen2_5_vl import hf_model_for
    from tests.support.trainer import make_packed_dataset

    packed = make_packed_dataset(tmp_path / "data", n_samples=12, seed=5, seq_len=256)
    hf_dir = hf_model_for(packed, tmp_path / "hf", tied=False)
    hf_to_mcore(str(hf_dir), str(tmp_path / "mcore"), tp=2, pp=1, start_method=warm_start_method())
    sample = first_image_sample(str(packed))
    assert sample.image_grid_thw is not None and sample.pixel_values is not None
    assert int((sample.tokens == sample.image_pad_id).sum()) == int(sample.image_grid_thw.prod(-1).sum()) // 4

    cpu_backend.activate()  # the test is the entry point: it sets up the CPU backend (no CUDA)
    ours = mcore_logits(str(tmp_path / "mcore"), sample)
    theirs = hf_logits(str(hf_dir), sample)
    assert ours.shape == theirs.shape == (sample.tokens.numel(), ours.shape[1])
    diff = float((ours - theirs).abs().max())
    assert diff < 1e-4, diff

    tensors = load_file(str(hf_dir / "model.safetensors"))
    name = next(k for k in tensors if "merger" in k and k.endswith("weight") and tensors[k].dim() == 2)
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    control = float((ours - hf_logits(str(hf_dir), sample)).abs().max())
    print(f"max abs diff {diff:.3e}; with {name} scaled: {control:.3e}")
    assert control > 100 * max(diff, 1e-6)
    assert torch.isfinite(ours).all()
