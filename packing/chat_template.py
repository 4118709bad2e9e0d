"""How a conversation becomes text: `ChatTemplate`, the model folder's Jinja template (`mmpack.packing.jinja_chat`)
or mmpack's built-in Qwen rendering

    <|im_start|>{role}\\n{content}<|im_end|>\\n        (per message)

with each `<image>` as `<|vision_start|>` + N x `<|image_pad|>` + `<|vision_end|>` (each `<video>` with
`<|video_pad|>`), and the character spans the loss mask, turn boundaries and media expansion need.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from mmpack.packing.jinja_chat import IMAGE_TAG, MEDIA_TAG_RE, VIDEO_TAG, JinjaChat, RenderedChat
from mmpack.packing.tokenizer import SPECIAL_TOKENS, VIDEO_PAD

if TYPE_CHECKING:
    from mmpack.packing.chat import Conversation

_Rendered = RenderedChat
_MEDIA_TAG_RE = MEDIA_TAG_RE


@dataclass(frozen=True)
class ChatTemplate:
    """How a conversation becomes text: the model folder's Jinja template (`source`), or None for mmpack's
    built-in Qwen rendering.

    `default_system` is the system prompt given to a conversation without one (with a Jinja template it
    overrides the template's own default; without one, None adds none); `no_default_system` leaves out the
    template's own default system turn. `variables` are the special tokens the template sees (`bos_token`, ...).
    """

    default_system: str | None = None
    source: str | None = None
    variables: tuple[tuple[str, str], ...] = ()
    no_default_system: bool = False
    origin: str = "chat template"

    def __post_init__(self) -> None:
        if self.default_system is not None and self.no_default_system:
            raise ValueError("--default-system and --no-default-system exclude each other; keep one")

    @property
    def name(self) -> str:
        return "qwen" if self.source is None else "jinja"

    @cached_property
    def jinja(self) -> JinjaChat:
        """The compiled template (built once per object, in the process that renders)."""
        assert self.source is not None
        return JinjaChat(self.source, dict(self.variables), self.origin)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "jinja"}  # a compiled template does not pickle

    def with_default_system(self, conv: Conversation) -> tuple[tuple[str, str], ...]:
        """The messages to render: the conversation's, with the default system prompt if it applies."""
        if self.default_system is not None and conv.messages and conv.messages[0][0] != "system":
            return (("system", self.default_system), *conv.messages)
        return conv.messages

    def render(
        self, messages: Sequence[tuple[str, str]], image_counts: Sequence[int], video_counts: Sequence[int]
    ) -> _Rendered:
        """`messages` (after `with_default_system`) as text, with `image_counts` / `video_counts` pads per media."""
        if self.source is None:
            return _render(messages, image_counts, video_counts, _ALL_SPECIALS)
        if any(n != 1 for n in (*image_counts, *video_counts)):
            raise ValueError("a Jinja chat template renders one pad per image / video")
        return self.jinja.render(messages, drop_default_turn=self.no_default_system)

    def effective_default_system(self) -> str | None:
        """The system prompt a conversation without one gets."""
        if self.default_system is not None or self.source is None or self.no_default_system:
            return self.default_system
        return self.jinja.default_system

    def to_dict(self) -> dict[str, Any]:
        """The manifest's "chat_template" entry."""
        out: dict[str, Any] = {"name": self.name, "default_system": self.effective_default_system()}
        if self.source is not None:
            out |= {"origin": self.origin, "sha256": hashlib.sha256(self.source.encode()).hexdigest()}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChatTemplate:
        """The built-in template of a manifest's "chat_template" entry (a Jinja template's source is not kept)."""
        if d.get("name", "qwen") != "qwen":
            raise ValueError(
                f"chat template {d.get('name')!r} cannot be rebuilt from a manifest; only 'qwen' can"
            )
        return cls(default_system=d.get("default_system"))


def render_conversation(
    messages: Sequence[tuple[str, str]],
    image_token_counts: Sequence[int],
    specials: dict[str, str] | None = None,
    video_token_counts: Sequence[int] = (),
) -> str:
    """The rendered chat text of `messages` (what gets encoded), images and videos expanded."""
    return _render(messages, image_token_counts, video_token_counts, specials or _ALL_SPECIALS).text


_ALL_SPECIALS = {**SPECIAL_TOKENS, "video_pad": VIDEO_PAD}


def _render(
    messages: Sequence[tuple[str, str]],
    image_token_counts: Sequence[int],
    video_token_counts: Sequence[int],
    specials: dict[str, str],
) -> _Rendered:
    parts: list[str] = []
    pos = 0
    out = _Rendered("", [], [], [])
    counts = {IMAGE_TAG: iter(image_token_counts), VIDEO_TAG: iter(video_token_counts)}
    pads = {IMAGE_TAG: specials["image_pad"], VIDEO_TAG: specials.get("video_pad", VIDEO_PAD)}

    def emit(s: str) -> None:
        nonlocal pos
        parts.append(s)
        pos += len(s)

    for role, content in messages:
        emit(f"{specials['im_start']}{role}\n")
        for j, chunk in enumerate(_MEDIA_TAG_RE.split(content)):
            if j % 2:  # a tag: the split keeps them at odd positions
                start = pos
                emit(specials["vision_start"] + pads[chunk] * next(counts[chunk]) + specials["vision_end"])
                out.media_char_spans.append((chunk, start, pos))
                continue
            if role == "assistant" and chunk:
                out.target_spans.append((pos, pos + len(chunk)))
            emit(chunk)
        if role == "assistant":
            out.target_spans.append((pos, pos + len(specials["im_end"])))
        emit(specials["im_end"] + "\n")
        out.message_ends.append(pos)
    out.text = "".join(parts)
    return out
