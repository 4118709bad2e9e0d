"""`mmpack pack --model DIR`: the tokenizer, the image and video rules and the chat template of a job from an HF
model folder.

A model folder (as `save_pretrained` writes it) holds `tokenizer.json`, `preprocessor_config.json` and its chat
template; the preprocessor config settles patch, merge and temporal patch sizes, min/max pixels, mean/std,
rescale factor and resampling, read as transformers 5 reads it (`ImageTokenRule.from_preprocessor_config`).
`-t DIR` where DIR holds a `preprocessor_config.json` is the same as `--model DIR`. Without a model folder, the
image flags and their defaults give the rule. A Qwen3-VL folder's `video_preprocessor_config.json` gives the
video rule (`resolve_video_rule`), and so does a LLaVA-OneVision-2 folder (`config.json` model_type
`llava_onevision2[_moe]`: its processor's rule, `mmpack.packing.video_tokens_ov2`); otherwise the --video-* flags
do. The chat template
(`mmpack.packing.jinja_chat`) is that of `--model DIR`, else of `-t DIR` (a folder); `--chat-template FILE`
names another, `--chat-template builtin` (and a tokenizer file or a folder without one) gives mmpack's built-in
Qwen rendering.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mmpack.offline_packing.config import SHARED_PATCH_FIELDS
from mmpack.packing import video_tokens_ov2
from mmpack.packing.image_tokens import (
    PREPROCESSOR_CONFIG,
    ImageTokenRule,
    load_model_image_rule,
    read_processor_config,
)
from mmpack.packing.jinja_chat import ChatTemplateError, read_folder_template
from mmpack.packing.tokenizer import TOKENIZER_FILE
from mmpack.packing.video_tokens import VideoTokenRule
from mmpack.packing.video_tokens_qwen3 import (
    PROCESSOR_DEFAULTS,
    PROCESSOR_TYPE,
    VIDEO_PREPROCESSOR_CONFIG,
    rule_fields,
)

BUILTIN_TEMPLATE = "builtin"

# Image-rule fields that also have a flag (--patch-size, ...): a flag that contradicts the model folder is an
# error, since the trainer refuses a dataset whose rule differs from its model's.
RULE_FLAG_FIELDS = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels")


def model_folder_of(model: str | None, tokenizer: str | None) -> str | None:
    """The model folder of the flags: `--model`, else `-t` when it is a folder with a preprocessor config."""
    if model is not None:
        return model
    if tokenizer is not None and os.path.isfile(os.path.join(tokenizer, PREPROCESSOR_CONFIG)):
        return tokenizer
    return None


def resolve_image_rule(
    model: str | None, tokenizer: str | None, flags: dict[str, int]
) -> tuple[str | None, ImageTokenRule]:
    """(tokenizer path, image rule of the job) from `--model`, `-t` and the image flags.

    `flags` maps those of RULE_FLAG_FIELDS given on the command line to their values; without a model folder
    they and the rule's defaults are the rule.

    Raises:
        ValueError: the model folder is missing a file, or a flag contradicts its preprocessor config.
    """
    folder = model_folder_of(model, tokenizer)
    if folder is None:
        return tokenizer, ImageTokenRule(**flags)  # type: ignore[arg-type]  # int fields only
    if not os.path.isdir(folder):
        raise ValueError(f"--model {folder}: not a folder (expected an HF model folder)")
    model_rule = load_model_image_rule(folder)
    if model_rule is None:
        raise ValueError(
            f"--model {folder}: no {PREPROCESSOR_CONFIG} in it; pass -t for the tokenizer and the image flags "
            "(--min-pixels, --max-pixels, ...) instead"
        )
    for name, value in flags.items():
        if value != getattr(model_rule, name):
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{flag} {value} disagrees with {os.path.join(folder, PREPROCESSOR_CONFIG)} ({name} "
                f"{getattr(model_rule, name)}): the trainer refuses a dataset whose image rule differs from its "
                f"model's; drop {flag} or change the model folder's {PREPROCESSOR_CONFIG}"
            )
    if tokenizer is None:
        if not os.path.isfile(os.path.join(folder, TOKENIZER_FILE)):
            raise ValueError(f"--model {folder}: no {TOKENIZER_FILE} in it; pass -t TOKENIZER")
        tokenizer = folder
    return tokenizer, model_rule


# Video-rule options with a flag (--video-fps, ..., --video-rule) -> the VideoTokenRule field each sets
VIDEO_FLAG_FIELDS = {
    "video_fps": "fps",
    "video_min_frames": "min_frames",
    "video_max_frames": "max_frames",
    "video_min_pixels": "min_pixels",
    "video_max_pixels": "max_pixels",
    "video_total_pixels": "total_pixels",
    "video_style": "style",
}


def _video_flag(option: str) -> str:
    return "--video-rule" if option == "video_style" else "--" + option.replace("_", "-")


def _model_video_fields(folder: str | None) -> tuple[str, dict[str, Any]] | None:
    """(file, VideoTokenRule fields) of the folder's Qwen3-VL video preprocessor config; None without one."""
    found = read_processor_config(folder, VIDEO_PREPROCESSOR_CONFIG) if folder else None
    if found is None or found[1].get("video_processor_type") != PROCESSOR_TYPE:
        return None  # other processors' videos follow qwen-vl-utils (the flags), as before
    path, config = found
    return path, rule_fields(config, source=path)


# the model types whose processor writes LLaVA-OneVision-2's video blocks
OV2_MODEL_TYPES = ("llava_onevision2", "llava_onevision2_moe")
# the --video-* options that rule takes (its video processor's constructor arguments); the others are refused
OV2_VIDEO_OPTIONS = ("video_max_frames", "video_min_pixels", "video_max_pixels", "video_style")


def _is_ov2_folder(folder: str | None) -> bool:
    path = os.path.join(folder, "config.json") if folder else ""
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("model_type") in OV2_MODEL_TYPES


def _ov2_video_rule(
    given: dict[str, Any], patch: dict[str, Any], image_rule: ImageTokenRule, where: str
) -> VideoTokenRule:
    """The LLaVA-OneVision-2 processor's video rule, its defaults under the --video-* options it takes."""
    refused = sorted(o for o, f in VIDEO_FLAG_FIELDS.items() if f in given and o not in OV2_VIDEO_OPTIONS)
    if refused:
        raise ValueError(
            f"{_video_flag(refused[0])}: {where} samples 8, 16 or --video-max-frames frames by duration "
            "(LLaVA-OneVision-2's processor); drop it"
        )
    if given.get("style", video_tokens_ov2.STYLE) != video_tokens_ov2.STYLE:
        raise ValueError(
            f"--video-rule {given['style']} disagrees with {where} ({video_tokens_ov2.STYLE}); drop --video-rule"
        )
    fields = {
        "max_frames": video_tokens_ov2.MAX_FRAMES, "min_pixels": video_tokens_ov2.MIN_PIXELS,
        "max_pixels": video_tokens_ov2.MAX_PIXELS, **given, "style": video_tokens_ov2.STYLE,
        "image_min_pixels": image_rule.min_pixels, "image_max_pixels": image_rule.max_pixels,
    }  # fmt: skip
    fields["min_frames"] = min(fields["max_frames"], 4)  # unused by this rule; kept valid for any max_frames
    return VideoTokenRule(**fields, **patch)


def resolve_video_rule(
    model: str | None, tokenizer: str | None, flags: dict[str, Any], image_rule: ImageTokenRule
) -> VideoTokenRule:
    """The video rule of the job from `--model DIR`'s Qwen3-VL video preprocessor config, else the --video-*
    flags (`flags`: those of VIDEO_FLAG_FIELDS given) over the defaults of the chosen `--video-rule`; its patch,
    merge and temporal patch sizes are `image_rule`'s (one vision tower).

    Raises:
        ValueError: a flag contradicts the model folder, or its video patch sizes are not its image rule's.
    """
    given = {VIDEO_FLAG_FIELDS[name]: value for name, value in flags.items()}
    patch = {name: getattr(image_rule, name) for name in SHARED_PATCH_FIELDS}
    folder = model_folder_of(model, tokenizer)
    if _is_ov2_folder(folder):
        return _ov2_video_rule(given, patch, image_rule, f"--model {folder}")
    if given.get("style") == video_tokens_ov2.STYLE:
        return _ov2_video_rule(given, patch, image_rule, "--video-rule llava_onevision2")
    found = _model_video_fields(folder)
    if found is None:
        base: dict[str, Any] = {}
        if given.get("style") == "qwen3_vl":  # the processor's defaults, not qwen-vl-utils'
            base = {f: PROCESSOR_DEFAULTS[f] for f in VIDEO_FLAG_FIELDS.values() if f in PROCESSOR_DEFAULTS}
        return VideoTokenRule(**base, **given, **patch)
    path, fields = found
    for name, value in patch.items():
        if fields[name] != value:
            raise ValueError(
                f"{path}: {name} {fields[name]} differs from the image rule's {value}: mmpack cuts videos "
                "into the image rule's patches"
            )
    rule = VideoTokenRule(**{f: fields[f] for f in VIDEO_FLAG_FIELDS.values() if f in fields}, **patch)
    for option, value in flags.items():
        wanted = getattr(rule, VIDEO_FLAG_FIELDS[option])
        if value != wanted:
            flag = _video_flag(option)
            raise ValueError(
                f"{flag} {value} disagrees with {path} ({wanted}): the videos would get other tokens than "
                f"the model's processor gives; drop {flag} or change the model folder's {VIDEO_PREPROCESSOR_CONFIG}"
            )
    return rule


def resolve_chat_template(model: str | None, tokenizer: str | None, flag: str | None) -> dict[str, Any]:
    """The chat template's options of the job (`chat_source`, `chat_origin`, `chat_variables`; see
    `mmpack.offline_packing.options`) from `--model`, `-t` and `--chat-template` (a .jinja file, or "builtin").

    Raises:
        ValueError: `--chat-template` names no file, or a template file cannot be read.
    """
    folder = model if model is not None else tokenizer if tokenizer and os.path.isdir(tokenizer) else None
    builtin: dict[str, Any] = {"chat_source": None, "chat_variables": ()}
    if flag == BUILTIN_TEMPLATE:
        return builtin
    found = read_folder_template(folder) if folder is not None and os.path.isdir(folder) else None
    variables = found[2] if found else {}
    if flag is not None:
        if not os.path.isfile(flag):
            raise ValueError(
                f"--chat-template {flag}: no such file (a .jinja template, or {BUILTIN_TEMPLATE!r})"
            )
        with open(flag, encoding="utf-8") as f:
            found = (f.read(), os.path.abspath(flag), variables)
    if found is None:
        return builtin
    source, origin, variables = found
    try:  # a template mmpack cannot follow is refused before any stage runs
        from mmpack.packing.jinja_chat import JinjaChat

        JinjaChat(source, variables, origin)
    except ChatTemplateError as exc:
        raise ValueError(f"{origin}: {exc}") from None
    return {"chat_source": source, "chat_origin": origin, "chat_variables": tuple(sorted(variables.items()))}
