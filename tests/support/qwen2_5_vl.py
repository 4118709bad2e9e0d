"""Qwen2.5-VL for the tests (no tests here): tiny random models written by transformers, the demo records packed
with the Qwen3 tokenizer, transformers' loss on the samples of a packed bin, and the family's tiny arch.

The session-wide model and image + video bin built from them are fixtures of tests/conftest.py.
"""

from __future__ import annotations

import io
import itertools
import json
import shutil
from pathlib import Path

from tests.support.hf_parity import loss_and_grads
from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, VIDEO_DEMO

VOCAB = 151936  # Qwen2.5-VL's padded vocabulary: holds every id of the Qwen3 tokenizer
MAX_PIXELS = 50176
VIDEO_FLAGS = ["--video-max-frames", "8", "--video-min-pixels", "3136", "--video-max-pixels", "50176"]


def qwen3_special_ids() -> dict[str, int]:
    """The Qwen3 tokenizer's ids of the three special tokens a Qwen2.5-VL config names."""
    ids = {t["content"]: t["id"] for t in json.loads(QWEN3_TOKENIZER.read_text())["added_tokens"]}
    return {k: ids[f"<|{k}|>"] for k in ("image_pad", "vision_start", "vision_end")}


def tiny_hf_model(path: Path, special: dict[str, int], num_layers: int = 2) -> Path:
    """A random Qwen2.5-VL written by transformers, with weights wide enough that every part matters."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from mmpack.trainer.models.protocol import TinyModelSpec
    from mmpack.trainer.models.qwen2_5_vl import FAMILY

    spec = TinyModelSpec(
        vocab_size=VOCAB,
        image_token_id=special["image_pad"],
        vision_start_token_id=special["vision_start"],
        vision_end_token_id=special["vision_end"],
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vision_depth=2,
        vision_hidden_size=32,
        vision_num_heads=2,
    )
    config = FAMILY.tiny_hf_config(spec)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return path


def hf_model_for(packed: Path, out: Path, *, tied: bool) -> Path:
    """A random two-layer Qwen2.5-VL (seed 1) whose vocabulary and special ids are those of ``packed``'s
    tokenizer; ``tied``: tied word embeddings."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from mmpack.trainer.models.protocol import TinyModelSpec
    from mmpack.trainer.models.qwen2_5_vl import FAMILY

    tok = json.loads((packed / "manifest.json").read_text())["tokenizer"]
    ids = tok["special_ids"]
    config = FAMILY.tiny_hf_config(TinyModelSpec(
        vocab_size=-(-tok["vocab_size"] // 128) * 128, image_token_id=ids["image_pad"],
        vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
        num_layers=2, tie_word_embeddings=tied,
    ))  # fmt: skip
    torch.manual_seed(1)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name and "ln_q" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out)
    return out


def tiny_arch():  # type: ignore[no-untyped-def]
    """The arch of the family's tiny config (vocabulary 512, special ids 500-502)."""
    from mmpack.trainer.models.protocol import TinyModelSpec
    from mmpack.trainer.models.qwen2_5_vl import FAMILY

    spec = TinyModelSpec(
        vocab_size=512, image_token_id=500, vision_start_token_id=501, vision_end_token_id=502
    )
    return FAMILY.arch_from_hf_config(FAMILY.tiny_hf_config(spec))


def pack(records: Path, tokenizer: Path, out: Path, seq_len: int) -> Path:
    """``mmpack pack`` of the records with the tokenizer (images up to ``MAX_PIXELS``)."""
    from mmpack.cli import main as mmpack

    args = ["pack", "-i", str(records), "-o", str(out), "-L", str(seq_len), "-t", str(tokenizer)]
    assert mmpack([*args, "--max-pixels", str(MAX_PIXELS), "--no-progress"]) == 0
    return out


def image_video_records(root: Path) -> Path:
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


def pack_image_video_bin(root: Path) -> Path:
    """`image_video_records` packed into one bin of 1024 tokens with the Qwen3 tokenizer and a small video
    rule (``VIDEO_FLAGS``)."""
    from mmpack.cli import main as mmpack

    packed = root / "packed"
    records = image_video_records(root)
    args = ["pack", "-i", str(records), "-o", str(packed), "-L", "1024", "-t", str(QWEN3_TOKENIZER)]
    assert mmpack([*args, "--max-pixels", "50176", *VIDEO_FLAGS, "--no-progress"]) == 0
    return packed


def samples_of_bin(packed: Path):  # type: ignore[no-untyped-def]
    """Each sample of the first bin as the loader gives it (tokens, labels) with its images' bytes."""
    import pyarrow as pa
    import torch

    from mmpack.dataloader import Topology, build_loader

    loader = build_loader(
        str(packed), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=0, num_epochs=1,
    )  # fmt: skip
    batch = next(iter(loader))
    loader.close()
    shard = next((packed / "shards").glob("*.arrow"))
    with pa.ipc.open_file(str(shard)) as f:
        record = f.get_batch(0)
    images = record.column("images")[0].as_py()
    image_pad = json.loads((packed / "manifest.json").read_text())["tokenizer"]["special_ids"]["image_pad"]
    cu = batch.cu_seqlens.tolist()
    real = int(batch.num_real_tokens)
    samples, next_image = [], 0
    for a, b in itertools.pairwise(cu):
        if b > real:
            break
        tokens = batch.tokens[0, a:b]
        grids = []
        pads = int((tokens == image_pad).sum())
        while pads > 0:
            g = batch.image_grid_thw[next_image]
            pads -= int(g.prod()) // 4
            grids.append(next_image)
            next_image += 1
        samples.append(
            {"tokens": tokens, "labels": batch.labels[0, a:b], "images": [images[i] for i in grids]}
        )
    assert next_image == len(images) and len(samples) >= 4
    assert sum(len(s["images"]) for s in samples) >= 4, "the bin should hold several images"
    return samples, torch.tensor(image_pad)


def reference(hf_dir: Path, packed: Path, max_pixels: int = MAX_PIXELS) -> dict:
    """transformers' loss on each sample of the first bin alone (images through Qwen2VLImageProcessorPil),
    summed over loss tokens / their count, and the gradients of that loss."""
    import torch
    from PIL import Image
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.train()  # no dropout in the config; gradients on
    processor = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=max_pixels)
    samples, image_pad = samples_of_bin(packed)
    inputs = []
    for s in samples:
        kwargs = {}
        if s["images"]:
            pix = processor([Image.open(io.BytesIO(b)) for b in s["images"]], return_tensors="pt")
            kwargs = {"pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"]}
        inputs.append((s["tokens"], s["labels"], (s["tokens"] == image_pad).int(), kwargs))
    return loss_and_grads(model, inputs)
