"""Parity with transformers for video: one packed bin holding a real image sample (mllm_demo) and a real video
sample (mllm_video_demo), Qwen3 tokenizer, `mmpack pack` with a small video rule, read by the loader and
trained for one iteration at lr 0 with `--hf-model` (a tiny random Qwen2.5-VL) at TP2 x PP2. The logged
`lm loss` must equal transformers' loss on the samples one by one, given the same `pixel_values`,
`pixel_values_videos`, `video_grid_thw` and `second_per_grid_ts`; a control with the video pixels zeroed
changes transformers' loss by far more than the tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.hf_parity import loader_samples, loss_and_grads, model_inputs_of, torchrun, train_args
from tests.support.shared import QWEN3_TOKENIZER

pytestmark = [pytest.mark.family]


def _reference(hf_dir: Path, packed: Path, zero_videos: bool = False) -> dict:
    """transformers' loss on each sample alone: sum of token cross-entropies over the loss tokens / count."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        return loss_and_grads(model, model_inputs_of(loader_samples(packed), zero_videos=zero_videos))


@pytest.mark.shared
@pytest.mark.ranks
@pytest.mark.slow
def test_image_and_video_bin_loss_equals_transformers(
    qwen2_5_vl_video_bin: tuple[Path, Path], tmp_path: Path
) -> None:
    hf_dir, packed = qwen2_5_vl_video_bin  # the session's tiny Qwen2.5-VL and image + video bin
    ids = {t["content"]: t["id"] for t in json.loads(QWEN3_TOKENIZER.read_text())["added_tokens"]}
    hf_config = json.loads((hf_dir / "config.json").read_text())
    assert hf_config["video_token_id"] == ids["<|video_pad|>"]
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["counts"]["bins"] == 1 and manifest["counts"]["samples_packed"] == 2
    assert manifest["counts"]["videos"] == 1 and manifest["counts"]["video_tokens"] > 0
    ref = _reference(hf_dir, packed)
    control = _reference(hf_dir, packed, zero_videos=True)
    gap = abs(control["loss"] - ref["loss"]) / ref["loss"]
    assert gap > 1e-3, f"control: zeroed video pixels change transformers' loss by only {gap:.2e}"
    metrics = tmp_path / "metrics.jsonl"
    train = [*train_args(hf_dir, packed, 2, 2), "--metrics-file", str(metrics)]
    torchrun(4, ["-m", "mmpack.trainer.pretrain_vlm", *train], tmp_path)
    step = json.loads(metrics.read_text().splitlines()[0])
    print(
        f"TP2xPP2 image+video bin: logged lm loss {step['loss']!r}, transformers {ref['loss']!r}, zeroed {control['loss']!r}"
    )
    assert step["target_tokens"] == ref["tokens"]
    assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5), (step["loss"], ref["loss"])


def test_a_dataset_video_pad_other_than_the_model_is_refused() -> None:
    from mmpack.trainer.build import check_data_matches_model
    from mmpack.trainer.data import DataInfo
    from mmpack.trainer.models.protocol import TinyModelSpec
    from mmpack.trainer.models.qwen2_5_vl import FAMILY, arch_from_hf_config

    arch = arch_from_hf_config(
        FAMILY.tiny_hf_config(
            TinyModelSpec(
                vocab_size=512, image_token_id=500, vision_start_token_id=501, vision_end_token_id=502
            )
        )
    )
    info = dict(
        seq_length=64,
        vocab_size=512,
        pad_id=0,
        image_pad_id=500,
        vision_start_id=501,
        vision_end_id=502,
        patch_size=14,
        merge_size=2,
    )
    assert arch.video_token_id == 501  # tiny configs put it right after the image pad, as Qwen's vocabulary
    check_data_matches_model(
        FAMILY, arch, DataInfo(**info, video_pad_id=501), "x"
    )  # control: the same id passes
    check_data_matches_model(
        FAMILY, arch, DataInfo(**info), "x"
    )  # a dataset without videos has no video id to check
    with pytest.raises(ValueError, match=r"<\|video_pad\|> is 503 in the dataset, 501 in the model"):
        check_data_matches_model(FAMILY, arch, DataInfo(**info, video_pad_id=503), "x")
    # videos planned by another processor's rule (other frames, sizes and tokens) are refused too
    same_rule = DataInfo(**info, video_pad_id=501, video_rule="qwen-vl-utils")
    check_data_matches_model(FAMILY, arch, same_rule, "x")
    with pytest.raises(
        ValueError, match="follow the qwen3_vl video rule, qwen2_5_vl's processor the qwen-vl"
    ):
        check_data_matches_model(FAMILY, arch, DataInfo(**info, video_pad_id=501, video_rule="qwen3_vl"), "x")
