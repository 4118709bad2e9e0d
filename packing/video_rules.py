"""The registry of video rules: each `VideoTokenRule.style` name and the module whose `VIDEO_STYLE` (a
`mmpack.packing.video_style.VideoStyle`) implements it.

A new processor's video rule is one module plus one line in `VIDEO_RULES`; everything else (the planner, the
manifest, the text expansion, `mmpack pack --model DIR` and `--video-rule`, the loader) reaches it through
`video_style` / `style_of_folder`. Modules are imported when first asked for.
"""

from __future__ import annotations

import importlib

from mmpack.packing.video_style import FolderClaim, VideoStyle

VIDEO_RULES: dict[str, str] = {
    "qwen-vl-utils": "mmpack.packing.video_tokens_qwen2",
    "qwen3_vl": "mmpack.packing.video_tokens_qwen3",
    "llava_onevision2": "mmpack.packing.video_tokens_ov2",
    "gemma4": "mmpack.packing.video_tokens_gemma4",
}
# the rule of the manifests written before there was a choice: they record no style
DEFAULT_STYLE = "qwen-vl-utils"


def style_names() -> tuple[str, ...]:
    """The registered style names, the default first."""
    return tuple(VIDEO_RULES)


def video_style(name: str) -> VideoStyle:
    """The style registered as `name`; ValueError naming the known ones otherwise."""
    if name not in VIDEO_RULES:
        raise ValueError(
            f"video rule style must be one of {style_names()}, got {name!r} (--video-rule, or the manifest's "
            "video_rule.style: a dataset packed by a newer mmpack needs that version to read it)"
        )
    found = getattr(importlib.import_module(VIDEO_RULES[name]), "VIDEO_STYLE", None)
    if not isinstance(found, VideoStyle) or found.name != name:
        raise TypeError(f"{VIDEO_RULES[name]}.VIDEO_STYLE is not the VideoStyle of {name!r}")
    return found


def style_of_folder(folder: str) -> tuple[VideoStyle, FolderClaim] | None:
    """The style that claims the model folder, with its claim; None where none does (ValueError where two do)."""
    claims = [(s, c) for s in map(video_style, VIDEO_RULES) if (c := s.claim(folder)) is not None]
    if len(claims) > 1:
        named = ", ".join(f"{s.name} ({c.source})" for s, c in claims)
        raise ValueError(
            f"model folder {folder} matches more than one video rule: {named}; keep one processor's files in it"
        )
    return claims[0] if claims else None
