"""`mmpack pack --model DIR`: the tokenizer, the image and video rules and the chat template of a job from an HF
model folder.

A model folder (as `save_pretrained` writes it) holds `tokenizer.json`, `preprocessor_config.json` and its chat
template; the preprocessor config settles patch, merge and temporal patch sizes, min/max pixels, mean/std,
rescale factor and resampling, read as transformers 5 reads it (`ImageTokenRule.from_preprocessor_config`; a
folder without one may hold the image processor in transformers 5's `processor_config.json`, as Gemma 4's do,
whose `image_processor_type` selects the image rule's style, `mmpack.packing.image_rules`).
`-t DIR` where DIR holds a `preprocessor_config.json` is the same as `--model DIR`; `--min-pixels` / `--max-pixels`
set the dataset's own pixel budget over the folder's. Without a model folder, the image flags and their defaults
give the rule. The video rule (`resolve_video_rule`) is that of the style in `mmpack.packing.video_rules` that
claims the folder (a Qwen3-VL `video_preprocessor_config.json`, a LLaVA-OneVision-2 `config.json` model_type:
each style says which); otherwise the --video-* flags give it. The chat template
(`mmpack.packing.jinja_chat`) is that of `--model DIR`, else of `-t DIR` (a folder); `--chat-template FILE`
names another, `--chat-template builtin` (and a tokenizer file or a folder without one) gives mmpack's built-in
Qwen rendering.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from mmpack.offline_packing.config import SHARED_PATCH_FIELDS
from mmpack.packing.image_tokens import (
    PREPROCESSOR_CONFIG,
    PROCESSOR_CONFIG,
    ImageTokenRule,
    image_processor_config,
    load_model_image_rule,
)
from mmpack.packing.jinja_chat import ChatTemplateError, read_folder_template
from mmpack.packing.tokenizer import TOKENIZER_FILE
from mmpack.packing.video_rules import DEFAULT_STYLE, style_of_folder, video_style
from mmpack.packing.video_style import FolderClaim, VideoStyle
from mmpack.packing.video_tokens import VideoTokenRule

BUILTIN_TEMPLATE = "builtin"

# Image-rule fields that also have a flag (--patch-size, ...). A geometry flag that contradicts the model folder
# is an error, since the trainer refuses a dataset cut into other patches than its model's; the pixel budget
# flags set the dataset's own budget over the folder's (the vision tower takes any grid).
RULE_FLAG_FIELDS = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels")
PIXEL_BUDGET_FIELDS = ("min_pixels", "max_pixels")


def model_folder_of(model: str | None, tokenizer: str | None) -> str | None:
    """The model folder of the flags: `--model`, else `-t` when it is a folder with a preprocessor config."""
    if model is not None:
        return model
    if tokenizer is not None and any(
        os.path.isfile(os.path.join(tokenizer, name)) for name in (PREPROCESSOR_CONFIG, PROCESSOR_CONFIG)
    ):
        return tokenizer
    return None


def resolve_image_rule(
    model: str | None, tokenizer: str | None, flags: dict[str, int]
) -> tuple[str | None, ImageTokenRule]:
    """(tokenizer path, image rule of the job) from `--model`, `-t` and the image flags.

    `flags` maps those of RULE_FLAG_FIELDS given on the command line to their values; without a model folder
    they and the rule's defaults are the rule, with one the folder's rule under the pixel budget flags given.

    Raises:
        ValueError: the model folder is missing a file, or a geometry flag contradicts its preprocessor config.
    """
    folder = model_folder_of(model, tokenizer)
    if folder is None:
        return tokenizer, ImageTokenRule(**flags)  # type: ignore[arg-type]  # int fields only
    if not os.path.isdir(folder):
        raise ValueError(f"--model {folder}: not a folder (expected an HF model folder)")
    model_rule = load_model_image_rule(folder)
    if model_rule is None:
        raise ValueError(
            f"--model {folder}: no {PREPROCESSOR_CONFIG} (nor a {PROCESSOR_CONFIG} with an image_processor) in it; "
            "pass -t for the tokenizer and the image flags (--min-pixels, --max-pixels, ...) instead"
        )
    found = image_processor_config(folder)
    where = found[0] if found else os.path.join(folder, PREPROCESSOR_CONFIG)
    for name, value in flags.items():
        if name not in PIXEL_BUDGET_FIELDS and value != getattr(model_rule, name):
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{flag} {value} disagrees with {where} ({name} "
                f"{getattr(model_rule, name)}): the trainer refuses a dataset cut into other patches than its "
                f"model's; drop {flag} or change the model folder's processor config"
            )
    budget = {name: flags.get(name, getattr(model_rule, name)) for name in PIXEL_BUDGET_FIELDS}
    try:
        model_rule = dataclasses.replace(
            model_rule, min_pixels=budget["min_pixels"], max_pixels=budget["max_pixels"]
        )
    except ValueError as e:
        raise ValueError(f"--min-pixels / --max-pixels over {where}: {e}") from None
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


def _video_flag(field: str) -> str:
    return "--video-rule" if field == "style" else "--video-" + field.replace("_", "-")


def resolve_video_rule(
    model: str | None, tokenizer: str | None, flags: dict[str, Any], image_rule: ImageTokenRule
) -> VideoTokenRule:
    """The video rule of the job: that of the style which claims the model folder (`mmpack.packing.video_rules`:
    a Qwen3-VL `video_preprocessor_config.json`, a LLaVA-OneVision-2 `config.json`), else of the `--video-rule`
    style (default qwen-vl-utils); its fields the folder's, or the style's defaults under the --video-* flags
    (`flags`: those of VIDEO_FLAG_FIELDS given); its patch, merge and temporal patch sizes `image_rule`'s (one
    vision tower).

    Raises:
        ValueError: a flag contradicts the model folder or is one the style does not take, or the folder's
            video patch sizes are not its image rule's.
    """
    given = {VIDEO_FLAG_FIELDS[name]: value for name, value in flags.items()}
    patch = {name: getattr(image_rule, name) for name in SHARED_PATCH_FIELDS}
    folder = model_folder_of(model, tokenizer)
    claimed = style_of_folder(folder) if folder is not None and os.path.isdir(folder) else None
    style, claim = claimed if claimed else (video_style(given.get("style", DEFAULT_STYLE)), None)
    where = claim.source if claim else f"--video-rule {style.name}"
    if given.get("style", style.name) != style.name:
        raise ValueError(
            f"--video-rule {given['style']} disagrees with {where} ({style.name}): the videos would get other "
            "tokens than the model's processor gives; drop --video-rule"
        )
    options = {k: v for k, v in given.items() if k != "style"}
    if claim is not None and claim.fixed:
        return _rule_of_folder(style, claim, options, patch, image_rule)
    refused = sorted(f for f in options if style.options is not None and f not in style.options)
    if refused:
        note = style.options_note or "does not take it"
        raise ValueError(f"{_video_flag(refused[0])}: {where} {note}; drop it")
    fields = style.rule_fields({**(claim.fields if claim else {}), **options}, image_rule)
    return VideoTokenRule(**fields, **patch, style=style.name)


def _rule_of_folder(
    style: VideoStyle, claim: FolderClaim, options: dict[str, Any], patch: dict[str, Any], image: ImageTokenRule,
) -> VideoTokenRule:  # fmt: skip
    """The rule a model folder fixes whole: its patch sizes must be the image rule's, and every --video-*
    option given must agree with it."""
    fields = dict(claim.fields)
    for name, value in patch.items():
        if fields.pop(name, value) != value:
            raise ValueError(
                f"{claim.source}: {name} {claim.fields[name]} differs from the image rule's {value}: mmpack cuts "
                "videos into the image rule's patches"
            )
    rule = VideoTokenRule(**style.rule_fields(fields, image), **patch, style=style.name)
    for name, value in options.items():
        wanted = getattr(rule, name)
        if value != wanted:
            flag = _video_flag(name)
            raise ValueError(
                f"{flag} {value} disagrees with {claim.source} ({wanted}): the videos would get other tokens "
                f"than the model's processor gives; drop {flag} or change {claim.source}"
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
