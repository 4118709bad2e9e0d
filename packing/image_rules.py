"""The registry of image rules: each `ImageTokenRule.image_style` name and the module whose `IMAGE_STYLE` (an
`ImageStyle`) implements it.

An image rule is a frozen set of numbers (`mmpack.packing.image_tokens.ImageTokenRule`: patch and merge sizes,
pixel budget, pixel normalisation) plus a style, the processor whose resize it follows. The style decides what
differs between processors: the size an image is resized to (`resized_hw`; the grid and token count follow from
it and the patch sizes), the ids an image's placeholder becomes in the text (`token_ids`), the control tokens
the tokenizer must have and a record's text may not hold (`control_tokens`), and which processor config selects
it (`claims`, `rule_fields`). A new processor's image rule is one module plus one line in
`IMAGE_RULES`; `ImageTokenRule`, `mmpack pack --model DIR` and the lengths stage reach it only through
`image_style` / `style_of_processor`. Modules are imported when first asked for.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from mmpack.packing.tokenizer import QWEN_TOKENS, ControlTokens

IMAGE_RULES: dict[str, str] = {
    "qwen2_vl": "mmpack.packing.image_tokens",
    "gemma4": "mmpack.packing.image_tokens_gemma4",
}
# the rule of the manifests written before there was a choice: they record no style
DEFAULT_IMAGE_STYLE = "qwen2_vl"


class ImageStyle(abc.ABC):
    """One processor's image rule (see the module docstring). Methods take the `ImageTokenRule` (`rule`) whose
    numbers they apply; subclasses set `name` and implement `resized_hw`."""

    name: str  # `ImageTokenRule.image_style`, as the manifest names it
    # the model's chat and media tokens (the tokenizer's `special_ids` roles): Qwen-VL's unless a style says
    control_tokens: ControlTokens = QWEN_TOKENS

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def check(self, rule: Any) -> None:
        """ValueError where `rule`'s numbers do not suit this style (beyond `ImageTokenRule`'s own checks)."""
        return None

    @abc.abstractmethod
    def resized_hw(self, rule: Any, height: int, width: int) -> tuple[int, int]:
        """(h', w') an image of height x width is resized to, multiples of `rule.factor`."""

    def token_ids(self, tokenizer: Any, num_tokens: int) -> np.ndarray | None:
        """The ids an image's whole placeholder (what the chat template wrote for it) becomes; None where only
        its pad is repeated `num_tokens` times (`<|vision_start|>` N x `<|image_pad|>` `<|vision_end|>`)."""
        return None

    def claims(self, config: Mapping[str, Any]) -> bool:
        """Whether an image processor config (`preprocessor_config.json`, or `processor_config.json`'s
        `image_processor`) is this style's processor's."""
        return False

    @abc.abstractmethod
    def rule_fields(self, config: Mapping[str, Any], source: str) -> dict[str, Any]:
        """`ImageTokenRule` fields (without `image_style`) of a processor config this style claims, read as
        transformers 5 reads it; ValueError naming `source` for a setting the rule cannot reproduce."""


def image_style_names() -> tuple[str, ...]:
    """The registered style names, the default first."""
    return tuple(IMAGE_RULES)


def image_style(name: str) -> ImageStyle:
    """The style registered as `name`; ValueError naming the known ones otherwise."""
    if name not in IMAGE_RULES:
        raise ValueError(
            f"image rule style must be one of {image_style_names()}, got {name!r} (the manifest's "
            "image_rule.image_style: a dataset packed by a newer mmpack needs that version to read it)"
        )
    found = getattr(importlib.import_module(IMAGE_RULES[name]), "IMAGE_STYLE", None)
    if not isinstance(found, ImageStyle) or found.name != name:
        raise TypeError(f"{IMAGE_RULES[name]}.IMAGE_STYLE is not the ImageStyle of {name!r}")
    return found


def style_of_processor(config: Mapping[str, Any], source: str) -> ImageStyle:
    """The style whose processor wrote the image processor `config`; ValueError naming `source` where none
    does."""
    for name in IMAGE_RULES:
        style = image_style(name)
        if style.claims(config):
            return style
    kind = config.get("image_processor_type")
    raise ValueError(
        f"{source}: image_processor_type {kind!r} is not a Qwen2-VL image processor nor another one mmpack has an "
        f"image rule for (styles {', '.join(image_style_names())})"
    )
