"""Parity with transformers for video: one packed bin holding a real image sample (mllm_demo) and a real video
sample (mllm_video_demo), Qwen3 tokenizer, `mmpack pack` with a small video rule, read by the loader and
trained for one iteration at lr 0 with `--hf-model` (a tiny random Qwen2.5-VL) at TP2 x PP2. The logged
`lm loss` must equal transformers' loss on the samples one by one, given the same `pixel_values`,
`pixel_values_videos`, `video_grid_thw` and `second_per_grid_ts`; a control with the video pixels zeroed
changes transformers' loss by far more than the tolerance.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, SHARED_DIR
from tests.test_trainer_hf_parity import _tiny_hf_model, _torchrun, _train_args, loss_and_grads

if TYPE_CHECKING:
    from mmpack.packing.batch import MicroBatch

VIDEO_DEMO = SHARED_DIR / "data" / "mllm_video_demo"
VIDEO_FLAGS = ["--video-max-frames", "8", "--video-min-pixels", "3136", "--video-max-pixels", "50176"]


def _inputs(root: Path) -> Path:
    """Two records: the first mllm_demo image record and the third mllm_video_demo video record."""
    media = root / "media"
    media.mkdir(parents=True)
    image_rec = json.loads(MLLM_DEMO_JSON.read_text())[0]
    video_rec = json.loads((VIDEO_DEMO / "mllm_video_demo.json").read_text())[2]
    for rel in {*image_rec["images"]}:
        shutil.copy(MLLM_DEMO_JSON.parent / rel, media / Path(rel).name)
    shutil.copy(VIDEO_DEMO / video_rec["videos"][0], media / Path(video_rec["videos"][0]).name)
    image_rec["images"] = [f"media/{Path(p).name}" for p in image_rec["images"]]
    video_rec["videos"] = [f"media/{Path(p).name}" for p in video_rec["videos"]]
    path = root / "mixed.jsonl"
    path.write_text(json.dumps(image_rec) + "\n" + json.dumps(video_rec) + "\n")
    return path


def _samples(packed: Path, layout: list | None = None, bins: int = 1) -> list[dict]:
    """Each sample of the first ``bins`` bins as the loader gives them, with their slices of the image and
    video inputs; `layout`: which samples must hold (images, videos), in any order (default: this file's
    two samples)."""
    from mmpack.dataloader import Topology, build_loader, load_manifest

    loader = build_loader(
        str(packed), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=0, num_epochs=1,
    )  # fmt: skip
    specials = json.loads((packed / "manifest.json").read_text())["tokenizer"]["special_ids"]
    merged = load_manifest(str(packed)).merge_size ** 2  # patches per token
    samples = []
    for batch in itertools.islice(loader, bins):
        assert batch is not None
        samples += _bin_samples(batch, specials["image_pad"], specials["video_pad"], merged)
    loader.close()
    if layout is None:
        layout = [(True, False), (False, True)]
    assert sorted(("image" in s, "video" in s) for s in samples) == sorted(layout)
    return samples


def _bin_samples(batch: MicroBatch, image_pad: int, video_pad: int, merged: int) -> list[dict]:
    import torch

    real = int(batch.num_real_tokens)
    samples, rows = [], {"image": 0, "video": 0}
    grids = {"image": iter(batch.image_grid_thw), "video": iter(batch.video_grid_thw)}
    seconds = iter(batch.second_per_grid_ts)
    for a, b in itertools.pairwise(batch.cu_seqlens.tolist()):
        if b > real:
            break
        tokens = batch.tokens[0, a:b]
        sample = {
            "tokens": tokens,
            "labels": batch.labels[0, a:b],
            "image_pad": image_pad,
            "video_pad": video_pad,
        }
        for kind, pad, pixels in (
            ("image", image_pad, "pixel_values"),
            ("video", video_pad, "pixel_values_videos"),
        ):
            pads, mine = int((tokens == pad).sum()), []
            while pads > 0:
                mine.append(next(grids[kind]))
                pads -= int(mine[-1].prod()) // merged
            if mine:
                n = sum(int(g.prod()) for g in mine)
                sample[kind] = (getattr(batch, pixels)[rows[kind] : rows[kind] + n], torch.stack(mine))
                rows[kind] += n
                if kind == "video":
                    sample["seconds"] = torch.stack([next(seconds) for _ in mine])
        samples.append(sample)
    return samples


def model_inputs_of(samples: list[dict], *, zero_videos: bool = False, seconds: bool = True) -> list:
    """(tokens, labels, mm_token_type_ids, model kwargs) of each sample for transformers (`seconds`: with
    Qwen2.5-VL's second_per_grid_ts)."""
    import torch

    out = []
    for s in samples:
        kwargs: dict = {}
        if "image" in s:
            kwargs |= {"pixel_values": s["image"][0], "image_grid_thw": s["image"][1]}
        if "video" in s:
            pixels = torch.zeros_like(s["video"][0]) if zero_videos else s["video"][0]
            kwargs |= {"pixel_values_videos": pixels, "video_grid_thw": s["video"][1]}
            if seconds:
                kwargs["second_per_grid_ts"] = s["seconds"]
        types = (s["tokens"] == s["image_pad"]).int() + 2 * (s["tokens"] == s["video_pad"]).int()
        out.append((s["tokens"], s["labels"], types, kwargs))
    return out


def _reference(hf_dir: Path, packed: Path, zero_videos: bool = False) -> dict:
    """transformers' loss on each sample alone: sum of token cross-entropies over the loss tokens / count."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        return loss_and_grads(model, model_inputs_of(_samples(packed), zero_videos=zero_videos))


@pytest.mark.slow
def test_image_and_video_bin_loss_equals_transformers(tmp_path: Path) -> None:
    from mmpack.offline_packing.cli import main as mmpack

    if not (QWEN3_TOKENIZER.is_file() and MLLM_DEMO_JSON.is_file() and VIDEO_DEMO.is_dir()):
        pytest.skip("needs ../shared (Qwen3 tokenizer, mllm_demo and mllm_video_demo)")
    ids = {t["content"]: t["id"] for t in json.loads(QWEN3_TOKENIZER.read_text())["added_tokens"]}
    special = {k: ids[f"<|{k}|>"] for k in ("image_pad", "vision_start", "vision_end")}
    hf_dir = _tiny_hf_model(tmp_path / "hf", special)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    assert hf_config["video_token_id"] == ids["<|video_pad|>"]
    packed = tmp_path / "packed"
    args = ["pack", "-i", str(_inputs(tmp_path)), "-o", str(packed), "-L", "1024", "-t", str(QWEN3_TOKENIZER)]
    assert mmpack([*args, "--max-pixels", "50176", *VIDEO_FLAGS, "--no-progress"]) == 0
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["counts"]["bins"] == 1 and manifest["counts"]["samples_packed"] == 2
    assert manifest["counts"]["videos"] == 1 and manifest["counts"]["video_tokens"] > 0
    ref = _reference(hf_dir, packed)
    control = _reference(hf_dir, packed, zero_videos=True)
    gap = abs(control["loss"] - ref["loss"]) / ref["loss"]
    assert gap > 1e-3, f"control: zeroed video pixels change transformers' loss by only {gap:.2e}"
    metrics = tmp_path / "metrics.jsonl"
    train = [*_train_args(hf_dir, packed, 2, 2), "--metrics-file", str(metrics)]
    _torchrun(4, ["-m", "mmpack.trainer.pretrain_vlm", *train], tmp_path)
    step = json.loads(metrics.read_text().splitlines()[0])
    print(
        f"TP2xPP2 image+video bin: logged lm loss {step['loss']!r}, transformers {ref['loss']!r}, zeroed {control['loss']!r}"
    )
    assert step["target_tokens"] == ref["tokens"]
    assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5), (step["loss"], ref["loss"])


def test_a_dataset_video_pad_other_than_the_model_is_refused() -> None:
    from mmpack.trainer.build import check_data_matches_model
    from mmpack.trainer.data import DataInfo
    from mmpack.trainer.models.qwen2_5_vl import FAMILY, arch_from_hf_config, tiny_hf_config

    arch = arch_from_hf_config(
        tiny_hf_config(vocab_size=512, image_token_id=500, vision_start_token_id=501, vision_end_token_id=502)
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
