"""LLaVA-OneVision-2 (dense and MoE) for the tests, against the modeling files LLaVA-OneVision-2 publishes
(../shared/reference/llava_onevision2, loaded in tests only): the reference's modules and classes, tiny random
models built from them, the reference's loss on the samples of a packed bin, the MoE runs' arguments and
their expert-swap control.

Also the worker of the OneVision steps (the -2 and -1.5 families, images and videos), on each rank:

    python -m tests.support.onevision OUT_DIR TRAINER_ARGS...

one step's loss at lr 0, then the loss under the controls (zeroed vision features, zeroed patch positions),
written by the logging rank to ``OUT_DIR/losses.json``.

The session-wide model folders are a fixture of tests/conftest.py (``onevision2_model``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from tests.support.hf_parity import loader_samples, step_loss
from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, REFERENCE_DIR, need_shared

VOCAB = 151936
MERGE = 2
# the tiny MoE variant: 4 experts, 2 per token, no load-balancing loss (the trainer's loss is the language loss
# the reference computes without router logits)
MOE_FIELDS = {"num_experts": 4, "moe_router_topk": 2, "ffn_hidden_size": 48, "moe_aux_loss_coeff": 0}


def image_config(patch_size: int = 14, merge_size: int = MERGE, max_pixels: int = 50176) -> dict[str, Any]:
    """A Qwen2-VL-style processor config (temporal patch 1) of that patch and merge size."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": patch_size,
        "temporal_patch_size": 1,
        "merge_size": merge_size,
        "min_pixels": 3136,
        "max_pixels": max_pixels,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }


IMAGE_CONFIG = image_config()
# LLaVA-OneVision-2's processor settings for its video paths (the demo videos' max_pixels; the processor's
# default mean and std)
VIDEO_IMAGE_CONFIG = {
    key: value
    for key, value in image_config(max_pixels=1605632).items()
    if key not in ("image_mean", "image_std")
}


def need_reference() -> None:
    """Steps aside without the Qwen3 tokenizer or the OneVision-2 reference in ../shared."""
    need_shared(
        QWEN3_TOKENIZER,
        REFERENCE_DIR / "llava_onevision2",
        what="the Qwen3 tokenizer, reference/llava_onevision2",
    )


def reference_modules():  # type: ignore[no-untyped-def]
    """The reference's configuration, modeling and video-processing modules, loaded from their folder."""
    if str(REFERENCE_DIR) not in sys.path:
        sys.path.insert(0, str(REFERENCE_DIR))
    from llava_onevision2 import configuration_llava_onevision2 as conf
    from llava_onevision2 import modeling_llava_onevision2 as modeling
    from llava_onevision2 import video_processing_llava_onevision2 as video

    return conf, modeling, video


def reference_classes(model_type: str):  # type: ignore[no-untyped-def]
    """(config class, model class) of the reference's dense or MoE variant."""
    reference_modules()
    if model_type == "llava_onevision2":
        from llava_onevision2 import configuration_llava_onevision2 as conf
        from llava_onevision2 import modeling_llava_onevision2 as modeling

        return conf.LlavaOnevision2Config, modeling.LlavaOnevision2ForConditionalGeneration
    from llava_onevision2 import configuration_llava_onevision2_moe as conf_moe
    from llava_onevision2 import modeling_llava_onevision2_moe as modeling_moe

    return conf_moe.LlavaOnevision2MoeConfig, modeling_moe.LlavaOnevision2ForConditionalGeneration


def tiny_hf_model(
    folder: Path, ids: dict[str, int], model_type: str = "llava_onevision2", *, patch_size: int = 14,
    merge_size: int = MERGE, max_pixels: int = 50176, **spec_fields: int,
) -> Path:  # fmt: skip
    """A random OneVision-2 (``model_type``: dense or MoE; its encoder's ``patch_size`` and
    ``merge_size``) built from the reference classes (config from the family's tiny config), with weights
    wide enough that every part matters, the processor config of that geometry (images up to
    ``max_pixels``) and the tokenizer."""
    import torch

    from mmpack.trainer.models import family
    from mmpack.trainer.models.protocol import TinyModelSpec

    conf, modeling = reference_classes(model_type)
    spec = TinyModelSpec(
        vocab_size=VOCAB, image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], num_layers=4, vision_depth=2, vision_num_heads=2,
        vision_hidden_size=64, patch_size=patch_size, merge_size=merge_size, **spec_fields,
    )  # fmt: skip
    config = family(model_type).tiny_hf_config(spec)
    assert config["video_token_id"] == ids["<|video_pad|>"]
    # small bases, so that every rotary frequency turns within a sample and an image
    config["text_config"]["rope_parameters"]["rope_theta"] = 100.0
    config["vision_config"]["rope_theta"] = 100.0
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = modeling(conf(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif "embed_tokens" in name or "lm_head" in name:
                param.normal_(0.0, 0.3)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(image_config(patch_size, merge_size, max_pixels))
    )
    shutil.copy(QWEN3_TOKENIZER, folder / "tokenizer.json")
    return folder


def image_samples(packed: Path, bins: int = 1) -> list[dict]:
    """Each sample of the first ``bins`` bins of the six mllm_demo records as the loader gives it, with its
    slice of the image inputs."""
    return loader_samples(packed, [(True, False)] * 6, bins=bins)


def reference_loss(
    hf_dir: Path, packed: Path, *, zero_pixels: bool = False, bins: int = 1, edit: Any = None
) -> dict:
    """The reference's loss over the samples of the first ``bins`` bins one by one (its own patch positions
    of each sample's grids); ``edit``: a function applied to the loaded model first (controls)."""
    import torch
    import torch.nn.functional as F

    _, _, video = reference_modules()
    config = json.loads((hf_dir / "config.json").read_text())
    merge = config["vision_config"]["spatial_merge_size"]
    model = reference_classes(config["model_type"])[1].from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    if edit is not None:
        edit(model)
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for s in image_samples(packed, bins):
            pixels, grids = s["image"]
            logits = model(
                input_ids=s["tokens"][None], pixel_values=torch.zeros_like(pixels) if zero_pixels else pixels,
                image_grid_thw=grids, patch_positions=video.build_patch_positions(grids, spatial_merge_size=merge),
            ).logits[0]  # fmt: skip
            keep = s["labels"] != -100
            total += F.cross_entropy(logits[keep].float(), s["labels"][keep], reduction="sum").double()
            count += int(keep.sum())
    return {"loss": float(total / count), "tokens": count}


def peft_lora_reference(setup: dict, targets: list[str], folder: Path, bins: int = 1) -> dict:
    """peft's side of a LoRA parity (tests/support/lora_parity.py) on the reference classes of ``setup``'s
    model folder, over the samples of its first ``bins`` bins (each with the reference's patch positions)."""
    from tests.support.hf_parity import model_inputs_of
    from tests.support.lora_parity import peft_reference

    _, _, video = reference_modules()
    config = json.loads((setup["hf"] / "config.json").read_text())
    merge = config["vision_config"]["spatial_merge_size"]
    inputs = model_inputs_of(image_samples(setup["packed"], bins))
    for _, _, _, kwargs in inputs:
        kwargs["patch_positions"] = video.build_patch_positions(
            kwargs["image_grid_thw"], spatial_merge_size=merge
        )
    model_class = reference_classes(config["model_type"])[1]
    return peft_reference(setup["hf"], setup["packed"], inputs, targets, folder, model_class)


def need_demo_records() -> None:
    """Steps aside without the Qwen3 tokenizer, the mllm_demo records or the OneVision-2 reference."""
    need_shared(
        QWEN3_TOKENIZER, MLLM_DEMO_JSON, REFERENCE_DIR / "llava_onevision2",
        what="Qwen3 tokenizer, mllm_demo, reference/llava_onevision2",
    )  # fmt: skip


def moe_args(setup: dict, tp: int, ep: int, *more: str, data: str = "packed") -> list[str]:
    """A MoE run of ``setup``'s model folder on ``setup[data]`` at TP x EP (expert TP 1; sequence parallel
    with TP), micro-batch 1, global batch 2, seed 5; ``more``: further flags."""
    return [
        "--hf-model", str(setup["hf"]), "--data-path", str(setup[data]),
        "--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(ep),
        "--expert-tensor-parallel-size", "1", *(["--sequence-parallel"] if tp > 1 else []),
        "--micro-batch-size", "1", "--global-batch-size", "2", "--log-interval", "1", "--num-workers", "0",
        "--seed", "5", *more,
    ]  # fmt: skip


def swap_experts(model) -> None:  # type: ignore[no-untyped-def]
    """Experts 0 and 1 of every layer of the reference MoE change places (router rows unchanged)."""
    import torch

    with torch.no_grad():
        for layer in model.model.language_model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                p[[0, 1]] = p[[1, 0]].clone()


def worker(out_dir: str, argv: list[str]) -> None:
    """One step's loss, then the loss under the controls (zeroed vision features, zeroed patch positions)."""
    import torch
    import torch.distributed as dist

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.arguments import parse_args
    from mmpack.trainer.training import Trainer, shutdown

    cpu_backend.activate()  # the test is the entry point: it sets up the CPU backend (no CUDA)
    trainer = Trainer(parse_args(argv))
    batches, _ = trainer.train_data.next_step()
    loss = step_loss(trainer._run_schedule(batches, forward_only=True))
    with torch.no_grad():
        flat = [
            b if b.patch_positions is None else dataclasses.replace(b, patch_positions=b.patch_positions * 0)
            for b in batches
        ]
        flat_positions = step_loss(trainer._run_schedule(flat, forward_only=True))
        stage = trainer.model.module
        if stage.vision is not None:
            stage.vision.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
        zeroed = step_loss(trainer._run_schedule(batches, forward_only=True))
    if trainer.is_logger:
        result = {"loss": loss, "zeroed_vision": zeroed, "zeroed_patch_positions": flat_positions}
        (Path(out_dir) / "losses.json").write_text(json.dumps(result))
    dist.barrier()
    trainer.close()
    shutdown()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2:])
