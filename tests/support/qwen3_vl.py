"""Qwen3-VL (dense and MoE) for the tests (no tests here): the small video rule the parity tests pack with,
tiny random models written by transformers with the model folder's processor configs and tokenizer, and
transformers' loss and gradients on the samples of the packed demo records.

The session-wide dense model and its packed dataset are a fixture of tests/conftest.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.support import qwen3_vl_reference as ref
from tests.support.hf_parity import loader_samples, loss_and_grads, model_inputs_of
from tests.support.shared import QWEN3_TOKENIZER

VOCAB = 151936  # Qwen3-VL's padded vocabulary: holds every id of the Qwen3 tokenizer
IMAGE_MAX_PIXELS = 50176
# the small video rule the parity tests pack with (few frames and tokens), besides the real one
SMALL_VIDEO_CONFIG = {
    **ref.VIDEO_CONFIG,
    "max_frames": 8,
    "size": {"shortest_edge": 4096, "longest_edge": 8 * 50176},
}
# the demo records of `hf_parity.records_file`: six image samples, one video sample
DEMO_LAYOUT = [(True, False)] * 6 + [(False, True)]


def tiny_hf_model(
    folder: Path, ids: dict[str, int], model_type: str = "qwen3_vl", **spec_fields: int
) -> Path:
    """A random model of a Qwen3-VL family (``model_type``) written by transformers, with weights wide
    enough that every part matters, and the model folder's processor configs and tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from mmpack.trainer.models import family
    from mmpack.trainer.models.protocol import TinyModelSpec

    spec = TinyModelSpec(
        vocab_size=VOCAB, image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], num_layers=4, vision_depth=3, patch_size=16,
        tie_word_embeddings=True, **spec_fields,
    )  # fmt: skip
    config = family(model_type).tiny_hf_config(spec)
    assert config["video_token_id"] == ids["<|video_pad|>"]
    assert config["vision_config"]["deepstack_visual_indexes"] == [0, 1]
    # a small base, so that every rotary frequency turns within a sample: a wrong frequency layout shows
    config["text_config"]["rope_parameters"]["rope_theta"] = 100.0
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif "embed_tokens" in name:  # the tied output layer too: peaked logits, a loss that moves
                param.normal_(0.0, 0.3)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    image = {**ref.IMAGE_CONFIG, "size": {"shortest_edge": 3136, "longest_edge": IMAGE_MAX_PIXELS}}
    (folder / "preprocessor_config.json").write_text(json.dumps(image))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(SMALL_VIDEO_CONFIG))
    shutil.copy(QWEN3_TOKENIZER, folder / "tokenizer.json")
    return folder


def samples(packed: Path, bins: int = 1) -> list[dict]:
    """Each sample of the first ``bins`` bins of the packed demo records (six image samples and a video
    sample) as the loader gives them, with their slices of the image and video inputs."""
    return loader_samples(packed, DEMO_LAYOUT, bins=bins)


def reference(hf_dir: Path, packed: Path, bins: int = 1) -> dict:
    """transformers' loss on each sample of the first ``bins`` bins alone and the gradients of that loss."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()  # no dropout in the config; gradients on
    return loss_and_grads(model, model_inputs_of(samples(packed, bins), seconds=False))
