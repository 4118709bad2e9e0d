"""The Gemma 4 image rule (transformers' `Gemma4ImageProcessor` and `Gemma4Processor`):
`ImageTokenRule(image_style="gemma4")` applies it (`IMAGE_STYLE`), and a model folder whose image processor
config names `Gemma4ImageProcessor` selects it.

The processor resizes every image, up or down, keeping its aspect ratio, to the largest size of whole
(patch x pooling)-pixel blocks that holds at most `max_soft_tokens` pooled tokens. In `ImageTokenRule` terms
`patch_size` is the patch (16), `merge_size` the pooling kernel (3), `factor` = patch x pooling (48) and
`max_pixels` = max_soft_tokens x factor^2 (the budget in pixels); `min_pixels` is unused::

    s        = sqrt(max_pixels / (h * w))
    h', w'   = floor(h * s / factor) * factor, floor(w * s / factor) * factor
    a side that comes out 0 is `factor`, and the other floor(long / short) * factor, at most
               max_soft_tokens * factor   (an image narrower than one block in that direction)
    tokens   = (h' / factor) * (w' / factor)

Each image becomes ``<|image>`` + tokens x ``<|image|>`` + ``<image|>`` in the text (the chat template writes
one ``<|image|>`` per image; the processor expands it). A tokenizer for these rules needs Gemma 4's media and turn
tokens (`CONTROL_TOKENS`), not Qwen's; its `special_ids` then name ``<|image|>`` image_pad and ``<|video|>``
video_pad (the tokens repeated per image and video token).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from mmpack.packing.image_rules import ImageStyle
from mmpack.packing.tokenizer import ControlTokens

STYLE = "gemma4"
PROCESSOR_TYPES = ("Gemma4ImageProcessor", "Gemma4ImageProcessorPil")
# the soft-token budgets the processor accepts
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
# `Gemma4ImageProcessorPil`'s class defaults, which a config without the key keeps
PATCH_SIZE = 16
POOLING_KERNEL_SIZE = 3
MAX_SOFT_TOKENS = 280
# the text of one image: begin, soft token, end; a video frame's soft token
BOI, IMAGE_SOFT, EOI = "<|image>", "<|image|>", "<image|>"
VIDEO_SOFT = "<|video|>"
# Gemma 4's control tokens: the media and turn tokens its processor and template write are required; the others
# of its tokenizer are recorded where present, and all are reserved (a record's text may not hold them)
CONTROL_TOKENS = ControlTokens(
    "gemma4",
    required=(
        ("image_start", BOI),
        ("image_pad", IMAGE_SOFT),
        ("image_end", EOI),
        ("video_pad", VIDEO_SOFT),
        ("turn_start", "<|turn>"),
        ("turn_end", "<turn|>"),
    ),
    optional=(
        ("pad", "<pad>"),
        ("bos", "<bos>"),
        ("eos", "<eos>"),
        ("audio_pad", "<|audio|>"),
        ("audio_start", "<|audio>"),
        ("audio_end", "<audio|>"),
        ("channel_start", "<|channel>"),
        ("channel_end", "<channel|>"),
        ("think", "<|think|>"),
    ),
)


def budget_resize(height: int, width: int, *, factor: int, max_soft_tokens: int) -> tuple[int, int]:
    """(h', w'): the aspect-kept size of whole `factor`-pixel blocks, at most `max_soft_tokens` blocks (the module
    docstring). ValueError where no such size exists."""
    scale = math.sqrt(max_soft_tokens * factor * factor / (height * width))
    h_bar = math.floor(height * scale / factor) * factor
    w_bar = math.floor(width * scale / factor) * factor
    if h_bar == 0 and w_bar == 0:
        raise ValueError(f"an image of {width}x{height} (w x h) resizes to no {factor}-pixel block")
    longest = max_soft_tokens * factor
    if h_bar == 0:
        h_bar, w_bar = factor, min(width // height * factor, longest)
    elif w_bar == 0:
        h_bar, w_bar = min(height // width * factor, longest), factor
    if h_bar * w_bar > max_soft_tokens * factor * factor:
        raise ValueError(f"an image of {width}x{height} (w x h) resizes past {max_soft_tokens} tokens")
    return h_bar, w_bar


def max_soft_tokens(rule: Any) -> int:
    """The rule's token budget per image (`max_pixels` // factor^2: a `--max-pixels` between two budgets takes the
    lower)."""
    return int(rule.max_pixels // (rule.factor * rule.factor))


def media_ids(tokenizer: Any, soft_token: str, num_tokens: int) -> list[int]:
    """The ids of ``<|image>`` + `num_tokens` x `soft_token` + ``<image|>``, each a single token of `tokenizer`."""
    ids = []
    for literal in (BOI, soft_token, EOI):
        found = tokenizer.encode(literal)
        if len(found) != 1:
            raise ValueError(
                f"tokenizer {tokenizer.name} does not encode {literal} as one token: not a Gemma 4 tokenizer"
            )
        ids.append(int(found[0]))
    return [ids[0], *[ids[1]] * num_tokens, ids[2]]


class Gemma4ImageStyle(ImageStyle):
    """Gemma 4's processor (see the module docstring)."""

    name = STYLE
    control_tokens = CONTROL_TOKENS

    def check(self, rule: Any) -> None:
        if rule.max_pixels < rule.factor * rule.factor:
            raise ValueError(
                f"the {STYLE} image rule needs max_pixels (max_soft_tokens x factor^2) of at least one "
                f"{rule.factor}-pixel block, got {rule.max_pixels}"
            )

    def resized_hw(self, rule: Any, height: int, width: int) -> tuple[int, int]:
        from mmpack.packing.image_tokens import ImageSizeError

        try:
            return budget_resize(height, width, factor=rule.factor, max_soft_tokens=max_soft_tokens(rule))
        except ValueError as exc:
            raise ImageSizeError("image_size_invalid", str(exc)) from None

    def token_ids(self, tokenizer: Any, num_tokens: int) -> np.ndarray | None:
        return np.asarray(media_ids(tokenizer, IMAGE_SOFT, num_tokens), dtype=np.uint32)

    def claims(self, config: Mapping[str, Any]) -> bool:
        return config.get("image_processor_type") in PROCESSOR_TYPES

    def rule_fields(self, config: Mapping[str, Any], source: str) -> dict[str, Any]:
        """The fields of a `Gemma4ImageProcessor` config: patch, pooling and budget; mean 0 and std 1 where the
        processor does not normalise (it then only rescales)."""
        for flag in ("do_resize", "do_rescale", "do_convert_rgb"):
            if config.get(flag, True) is not True:
                raise ValueError(f"{source}: {flag}={config[flag]!r} is not supported (mmpack needs true)")
        normalise = config.get("do_normalize", False)
        try:
            patch = int(config.get("patch_size", PATCH_SIZE))
            pooling = int(config.get("pooling_kernel_size", POOLING_KERNEL_SIZE))
            budget = int(config.get("max_soft_tokens", MAX_SOFT_TOKENS))
            mean = (
                tuple(float(v) for v in config.get("image_mean", (0.0, 0.0, 0.0)))
                if normalise
                else (0.0,) * 3
            )
            std = (
                tuple(float(v) for v in config.get("image_std", (1.0, 1.0, 1.0))) if normalise else (1.0,) * 3
            )
            factor = patch * pooling
            if budget not in SOFT_TOKEN_BUDGETS:
                raise ValueError(
                    f"max_soft_tokens must be one of {SOFT_TOKEN_BUDGETS} (as its processor), got {budget}"
                )
            return {
                "patch_size": patch,
                "merge_size": pooling,
                "temporal_patch_size": 1,
                "min_pixels": factor * factor,
                "max_pixels": budget * factor * factor,
                "image_mean": mean,
                "image_std": std,
                "rescale_factor": float(config.get("rescale_factor", 1 / 255)),
                "resample": int(config.get("resample", 3)),
            }
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from exc


IMAGE_STYLE = Gemma4ImageStyle()
