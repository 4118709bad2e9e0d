"""Gemma 4 test folders and transformers' Gemma 4 processing as the packer's reference (tests/test_gemma4_packer.py).

Harness, not reference code: `model_folder` copies the shared stand-in (../shared/data/gemma4_tokenizer: a Qwen3 BPE
with Gemma 4's special tokens, its chat template and `processor_config.json`) into a model folder, as its
SOURCE.md says, optionally without Qwen's control tokens (as a real Gemma 4 tokenizer has none of them:
`edit_added_tokens`); `reference_processor` builds transformers' `Gemma4Processor` from that folder's files with its
PIL image processor (`Gemma4ImageProcessorPil`) and no video processor (`Gemma4VideoProcessor` needs
torchvision, which does not load here). The reference ids are transformers' own: `apply_chat_template`, then the
processor's call (images) or its `replace_video_token` (videos) and the tokenizer. For the trainer tests
(tests/test_gemma4_trainer.py): the tiny random `Gemma4Config` (`tiny_config`), its model, transformers' per-layer
masks of one sample (`hf_layer_masks`) and its loss of one record (`reference_inputs`, `reference_loss`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.fixtures_chat import hf_messages
from tests.support.shared import SHARED_DIR

GEMMA4_TOKENIZER_DIR = SHARED_DIR / "data" / "gemma4_tokenizer"
FOLDER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json")


def model_folder(folder: Path, *, max_soft_tokens: int | None = None, qwen_tokens: bool = True) -> Path:
    """A Gemma 4 model folder's text and processor files (no weights), the image budget `max_soft_tokens` where
    given (the stand-in's is 70); without `qwen_tokens`, its tokenizer lacks Qwen's control tokens."""
    from mmpack.packing.tokenizer import QWEN_TOKENS

    folder.mkdir(parents=True, exist_ok=True)
    for name in FOLDER_FILES:
        shutil.copyfile(GEMMA4_TOKENIZER_DIR / name, folder / name)
    if not qwen_tokens:
        edit_added_tokens(folder / "tokenizer.json", folder, drop=QWEN_TOKENS.literals)
    if max_soft_tokens is not None:
        path = folder / "processor_config.json"
        config = json.loads(path.read_text())
        config["image_processor"]["max_soft_tokens"] = max_soft_tokens
        config["image_seq_length"] = max_soft_tokens
        path.write_text(json.dumps(config, indent=2))
    return folder


def edit_added_tokens(
    source: Path, folder: Path, *, drop: Sequence[str] = (), add: Sequence[str] = ()
) -> Path:
    """`folder/tokenizer.json`: the tokenizer file `source` without the added tokens `drop` (the vocabulary then
    reads their text as ordinary text) and with the special tokens `add` (new ids after the last one)."""
    data = json.loads(source.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in drop]
    text = json.dumps(data, ensure_ascii=False)
    if add:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(text)
        tokenizer.add_special_tokens(list(add))
        text = tokenizer.to_str()
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "tokenizer.json"
    out.write_text(text)
    return out


def reference_processor(folder: Path) -> Any:
    """transformers' `Gemma4Processor` of `folder` with its PIL image processor and no video processor."""
    from transformers import AutoTokenizer
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    class WithoutVideo(
        Gemma4Processor
    ):  # harness: the processor's class check would ask for the video processor
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    config = json.loads((folder / "processor_config.json").read_text())

    def settings(key: str, kind: str) -> dict:
        return {k: v for k, v in config[key].items() if k != kind}

    return WithoutVideo(
        feature_extractor=Gemma4AudioFeatureExtractor(
            **settings("feature_extractor", "feature_extractor_type")
        ),
        image_processor=Gemma4ImageProcessorPil(**settings("image_processor", "image_processor_type")),
        tokenizer=AutoTokenizer.from_pretrained(str(folder)),
        video_processor=None,
        chat_template=(folder / "chat_template.jinja").read_text(),
        image_seq_length=config["image_seq_length"],
    )


def video_metadata(path: Path) -> tuple[int, float, int, int]:
    """(frames, fps, height, width) of a video's first stream from its container, read with PyAV."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        rate = stream.average_rate
        assert rate is not None, path
        return int(stream.frames), float(rate), int(stream.height), int(stream.width)


def reference_video_text(processor: Any, path: Path) -> tuple[str, list[int], int]:
    """(the text transformers' processor writes for the video at `path`, its frame indices, its tokens per frame),
    from its sampling (`default_sample_indices_fn` with the config's `num_frames`), its size rule and its
    `replace_video_token`."""
    from transformers.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    config = json.loads((Path(processor.tokenizer.name_or_path) / "processor_config.json").read_text())
    video = config["video_processor"]
    frames, fps, height, width = video_metadata(path)
    meta = VideoMetadata(total_num_frames=frames, fps=fps, height=height, width=width)
    indices = default_sample_indices_fn(meta, num_frames=video["num_frames"])
    meta.frames_indices = indices  # type: ignore[assignment]  # transformers sets its ndarray here too
    pooling, patch = video["pooling_kernel_size"], video["patch_size"]
    h, w = get_aspect_ratio_preserving_size(
        height, width, patch, video["max_soft_tokens"] * pooling**2, pooling
    )
    per_frame = (h // patch) * (w // patch) // pooling**2
    text = processor.replace_video_token(
        {"num_soft_tokens_per_video": [per_frame], "video_metadata": [meta]}, 0
    )
    return text, [int(i) for i in indices], per_frame


def reference_sample(processor: Any, record: dict, root: Path) -> dict[str, np.ndarray]:
    """transformers' `input_ids` and `mm_token_type_ids` of one record (media paths relative to `root`)."""
    from PIL import Image

    text = processor.apply_chat_template(hf_messages(record["messages"]), tokenize=False)
    for rel in record.get("videos", ()):
        expansion, _, _ = reference_video_text(processor, root / rel)
        text = text.replace(processor.video_token, expansion, 1)
    images = [Image.open(root / rel) for rel in record.get("images", ())]
    if not images:
        ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": np.asarray(ids), "mm_token_type_ids": None}  # type: ignore[dict-item]
    out = processor(text=[text], images=[images], return_tensors="np")
    return {"input_ids": out["input_ids"][0], "mm_token_type_ids": out["mm_token_type_ids"][0]}


# The tiny random Gemma 4 of the trainer tests (tests/test_gemma4_trainer.py): two sliding layers between full
# ones, the last two sharing the earlier layers' keys and values with double-wide MLPs, full-attention layers with
# their own head size and values equal to their keys, per-layer embeddings and bidirectional image attention.
TINY_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
TINY_WINDOW = 16


def tiny_config(
    *, window: int = TINY_WINDOW, bidirectional: bool = True, layers: int = 4, experts: int = 0
) -> Any:
    """transformers' `Gemma4Config` of the tiny model, its token ids those of the stand-in tokenizer; `layers`
    (even): sliding and full layers alternating, the last two sharing KV; `experts`: the MoE variant with that many
    experts (2 per token) beside each layer's dense MLP."""
    from transformers import Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    ids = special_token_ids()
    layer_types = TINY_LAYER_TYPES[:2] * (layers // 2)
    text = Gemma4TextConfig(
        vocab_size=151_696, vocab_size_per_layer_input=151_696, hidden_size_per_layer_input=8,
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
        num_kv_shared_layers=2, use_double_wide_mlp=True, layer_types=layer_types,
        sliding_window=window, use_bidirectional_attention="vision" if bidirectional else None,
        final_logit_softcapping=30.0, pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"],
        eos_token_id=ids["<eos>"],
        **({"enable_moe_block": True, "num_experts": experts, "top_k_experts": 2, "moe_intermediate_size": 32}
           if experts else {}),
    )  # fmt: skip
    vision = Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, patch_size=16, pooling_kernel_size=3,
    )  # fmt: skip
    return Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None, image_token_id=ids["<|image|>"],
        boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"], video_token_id=ids["<|video|>"],
        audio_token_id=ids["<|audio|>"], boa_token_id=ids["<|audio>"], eoa_token_index=ids["<audio|>"],
    )  # fmt: skip


def special_token_ids() -> dict[str, int]:
    """The stand-in tokenizer's Gemma 4 special tokens by their text."""
    data = json.loads((GEMMA4_TOKENIZER_DIR / "tokenizer.json").read_text())
    return {t["content"]: int(t["id"]) for t in data["added_tokens"]}


def tiny_model(config: Any, seed: int = 0) -> Any:
    """A random `Gemma4ForConditionalGeneration` of `config` (float32, eval, eager attention)."""
    import torch
    from transformers import Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    return Gemma4ForConditionalGeneration(config).float().eval()


def hf_layer_masks(config: Any, mm_token_type_ids: Any) -> dict[str, Any]:
    """transformers' [T, T] allowed-attention matrices of one sample (a [T] `mm_token_type_ids` tensor) for the
    'full_attention' and 'sliding_attention' layers, as `Gemma4Model.forward` builds them."""
    import torch
    from transformers.masking_utils import create_masks_for_generate
    from transformers.models.gemma4.modeling_gemma4 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    text = config.get_text_config()
    text._attn_implementation = "eager"
    n = int(mm_token_type_ids.shape[0])
    kwargs = {
        "config": text, "inputs_embeds": torch.zeros(1, n, 1), "attention_mask": None,
        "past_key_values": None, "position_ids": torch.arange(n)[None],
    }  # fmt: skip
    if text.use_bidirectional_attention == "vision":
        blocks = get_block_sequence_ids_for_mask(mm_token_type_ids[None], device=torch.device("cpu"))
        masks = create_masks_for_vision_model(block_sequence_ids=blocks, **kwargs)
    else:
        masks = create_masks_for_generate(**kwargs)
    return {kind: _allowed(mask) for kind, mask in masks.items()}


def _allowed(mask: Any) -> Any:
    """A transformers eager mask (additive float or bool, [1, 1, T, T]) as a [T, T] bool matrix."""
    import torch

    m = mask[0, 0]
    return m if m.dtype == torch.bool else m == 0


def reference_inputs(processor: Any, record: dict, root: Path) -> dict[str, Any]:
    """transformers' model inputs of one image record (media paths relative to `root`): ids, `mm_token_type_ids`,
    pixels and patch positions, as torch tensors."""
    from PIL import Image

    text = processor.apply_chat_template(hf_messages(record["messages"]), tokenize=False)
    images = [Image.open(root / rel) for rel in record.get("images", ())]
    out = processor(text=[text], images=[images], return_tensors="pt")
    return {k: v for k, v in out.items() if k != "attention_mask"}


def reference_loss(model: Any, inputs: dict[str, Any]) -> float:
    """transformers' mean next-token cross-entropy of one sample over all its tokens."""
    import torch

    with torch.no_grad():
        return float(model(**inputs, labels=inputs["input_ids"]).loss)


# -- the vision tower (tests/test_gemma4_vision.py) ------------------------------------------------------------

VISION_KV_HEADS = 2  # grouped-query attention in the tower (the tiny config's has as many KV heads as heads)


def vision_model_folder(folder: Path, seed: int = 0) -> tuple[Path, Any]:
    """A tiny Gemma 4 folder (processor files and `save_pretrained` weights) whose vision tower has grouped KV
    heads and every vision and projector tensor random (transformers initialises norms and the position table
    to constants, under which swapped positions or norms would go unnoticed); returns (folder, model)."""
    import torch

    config = tiny_config()
    config.vision_config.num_key_value_heads = VISION_KV_HEADS
    model = tiny_model(config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "vision" in name:
                noise = torch.randn(param.shape, generator=gen)
                param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.2 * noise)
    model_folder(folder)
    model.save_pretrained(folder)
    return folder, model


def loader_image_inputs(folder: Path, paths: Sequence[Path]) -> tuple[Any, Any]:
    """(pixel_values [P, 3*p*p], image_grid_thw [n, 3]) of the images as the loader lays them out: the folder's
    Gemma 4 image rule (`resolve_image_rule`) and `image_to_patches`."""
    import torch
    from PIL import Image

    from mmpack.offline_packing.model_folder import resolve_image_rule
    from mmpack.packing.image_tokens import image_to_patches

    _, rule = resolve_image_rule(str(folder), None, {})
    pixels, grids = [], []
    for path in paths:
        with Image.open(path) as img:
            pixels.append(image_to_patches(img, rule))
            grids.append(rule.grid_thw(img.size[1], img.size[0]))
    return torch.from_numpy(np.concatenate(pixels)), torch.tensor(grids)


def reference_image_features(model: Any, folder: Path, paths: Sequence[Path]) -> Any:
    """transformers' soft tokens of the images ([tokens, text hidden], images in order): its PIL image processor
    of the folder's settings (as `reference_processor` builds it), then `get_image_features` (vision tower +
    `embed_vision`)."""
    import torch
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    settings = json.loads((folder / "processor_config.json").read_text())["image_processor"]
    settings.pop("image_processor_type")
    processor = Gemma4ImageProcessorPil(**settings)
    images = [Image.open(p) for p in paths]
    out = processor(images, return_tensors="pt")
    with torch.no_grad():
        features = model.model.get_image_features(out["pixel_values"], out["image_position_ids"])
    return torch.cat(list(features.pooler_output))


def load_vision_tower(folder: Path, *, tp_rank: int, tp_size: int) -> Any:
    """The family's vision tower (its megatron-core parallel state set up by the caller) with this rank's slices
    of the folder's weights, read through `vision_rules` by `hf_weights.read_shard`."""
    import torch

    from mmpack.trainer.models.gemma4.config import arch_from_hf_config
    from mmpack.trainer.models.gemma4.vision import Gemma4VisionTower, vision_rules, vision_tower_config
    from mmpack.trainer.models.hf_weights import open_hf_weights, read_shard

    arch = arch_from_hf_config(json.loads((folder / "config.json").read_text()))
    common = {
        "tensor_model_parallel_size": tp_size,
        "params_dtype": torch.float32,
        "use_cpu_initialization": True,
    }
    tower = Gemma4VisionTower(vision_tower_config(arch, common), arch)
    rules = vision_rules(arch)
    params = {f"vision.{n}": p for n, p in tower.named_parameters()}
    assert set(params) == set(rules), sorted(set(params) ^ set(rules))
    with open_hf_weights(folder) as reader, torch.no_grad():
        for name, param in params.items():
            param.copy_(read_shard(reader, rules[name], tp_rank, tp_size))
    return tower.eval()


def _vision_rank_main(folder: Path, inputs: Path, out: Path) -> None:
    """One rank of the TP tower test: the tower at TP = WORLD_SIZE on the saved inputs; rank r writes
    `out/rank{r}.pt` (its soft tokens and the gradient of one layer's query-norm weight), and the ranks save the
    tower's megatron-core checkpoint shards to `out/checkpoint` (`dist_checkpointing`)."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps

    from mmpack.trainer import cpu_backend

    cpu_backend.activate()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    ps.initialize_model_parallel(size, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    tower = load_vision_tower(folder, tp_rank=rank, tp_size=size)
    saved = torch.load(inputs)
    soft = tower(saved["pixel_values"], saved["image_grid_thw"])
    soft.pow(2).sum().backward()
    grad = tower.layers[0].self_attention.q_norm.weight.grad
    torch.save({"soft": soft.detach(), "q_norm_grad": grad}, out / f"rank{rank}.pt")
    (out / "checkpoint").mkdir(exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(tower.sharded_state_dict(prefix="vision."), str(out / "checkpoint"))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":  # a rank of `ranks.launch(N, ["-m", "tests.support.gemma4", FOLDER, INPUTS, OUT])`
    import sys

    _vision_rank_main(*(Path(a) for a in sys.argv[1:4]))
