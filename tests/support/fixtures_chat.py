"""A Qwen2-VL model folder for tests: the shared Qwen3 tokenizer, a tokenizer_config.json carrying Qwen2-VL's
chat template, and a preprocessor_config.json as transformers 5's Qwen2VLImageProcessorPil writes it, with
Qwen2-VL's pixel bounds (written as JSON: the folder is made without importing transformers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Qwen2-VL-Instruct's chat template (as its tokenizer_config.json ships it): a default system turn where a
# conversation has none, one vision placeholder per image / video part.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# What `Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056).save_pretrained` writes (transformers 5).
PREPROCESSOR_CONFIG = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "merge_size": 2,
    "patch_size": 14,
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"longest_edge": 12845056, "shortest_edge": 3136},
    "temporal_patch_size": 2,
}


def qwen2_vl_model_folder(folder: Path, tokenizer_file: Path, template: str = QWEN2_VL_CHAT_TEMPLATE) -> Path:
    """`folder` as a Qwen2-VL model folder around `tokenizer_file` (a Qwen tokenizer.json with a
    tokenizer_config.json beside it); the chat template is `template`."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer_file, folder / "tokenizer.json")
    config = json.loads((tokenizer_file.parent / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    return folder


def hf_messages(messages: list[dict]) -> list[dict]:
    """OV-2 / ShareGPT messages (role, content with `<image>` / `<video>` tags) as transformers takes them:
    a string, or, where a message holds media, a list of text / image / video parts."""
    import re

    out = []
    for m in messages:
        pieces = re.split(r"(<image>|<video>)", m["content"])
        if len(pieces) == 1:
            out.append({"role": m["role"], "content": m["content"]})
            continue
        parts = [
            {"type": p[1:-1]} if p in ("<image>", "<video>") else {"type": "text", "text": p}
            for p in pieces
            if p
        ]
        out.append({"role": m["role"], "content": parts})
    return out
