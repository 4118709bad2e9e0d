"""Raw records -> conversations -> token ids and loss mask.

`normalize_record` turns one LLaVA, ShareGPT, caption or text-only record into a `Conversation` (or raises
`SampleError` with a short reason code); `tokenize_conversation` renders it with a `ChatTemplate`: the model
folder's own Jinja template (`mmpack.packing.jinja_chat`: the text `apply_chat_template` gives), or, where
there is none, mmpack's built-in Qwen rendering

    <|im_start|>{role}\\n{content}<|im_end|>\\n        (per message)

In both, each `<image>` is `<|vision_start|>` + N x `<|image_pad|>` + `<|vision_end|>` (each `<video>`
`<|vision_start|>` + N x `<|video_pad|>` + `<|vision_end|>`, N from the video rule; under a rule that writes
timestamps, Qwen3-VL's, the one pad becomes `mmpack.packing.video_tokens_qwen3.placeholder_ids`; under
LLaVA-OneVision-2's, the whole block becomes `mmpack.packing.video_tokens_ov2.block_ids`); the whole
string is encoded once (so the ids equal a direct tokenizer encode of the rendered text) and the loss mask comes from
the token offsets. `truncate_sample` implements the `truncate` over-length policy.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mmpack.packing.chat_template import ChatTemplate
from mmpack.packing.chat_template import render_conversation as render_conversation  # its home: chat_template
from mmpack.packing.errors import MmpackError
from mmpack.packing.jinja_chat import IMAGE_TAG, MEDIA_FORMS, VIDEO_TAG
from mmpack.packing.jinja_chat import RenderedChat as _Rendered
from mmpack.packing.tokenizer import RESERVED_TOKENS, VIDEO_PAD, TextTokenizer

# Modalities a record may carry that the length model cannot count yet: the record keys and the tag that
# name each. Such records are rejects (`unsupported_modality`), never packed as text.
UNSUPPORTED_MODALITIES: dict[str, tuple[tuple[str, ...], str]] = {
    "audio": (("audio", "audios"), "<audio>"),
}
ROLES = ("system", "user", "assistant")
_ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
}


class SampleError(MmpackError, ValueError):
    """A raw sample that cannot be used; `reason` is a short snake_case code for rejects.jsonl.

    Reason codes raised here: malformed_record, unknown_role, empty_conversation, misplaced_system,
    no_assistant_turn, image_tag_mismatch, video_tag_mismatch, reserved_token_in_text, unsupported_modality.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message, reason=reason)

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


@dataclass(frozen=True)
class Conversation:
    """A normalised sample: messages in order, image paths in order of their `<image>` tags, video paths in
    order of their `<video>` tags."""

    messages: tuple[tuple[str, str], ...]
    images: tuple[str, ...] = ()
    sample_id: str = ""
    videos: tuple[str, ...] = ()


def normalize_record(obj: Any, *, source: str, line: int) -> Conversation:
    """One raw record (LLaVA / ShareGPT / caption / text-only) as a validated `Conversation`.

    A record is trainable only with at least one assistant message with non-empty content; the number of
    `<image>` tags over all messages must equal the number of images, that of `<video>` tags the number of
    videos (LLaVA `"video": str | [str]`, ShareGPT `"videos"`). `sample_id` is the record's "id" if it has
    one, else "{source}:{line}".
    """
    if not isinstance(obj, dict):
        raise SampleError("malformed_record", f"expected a JSON object, got {type(obj).__name__}")
    _refuse_unsupported_modalities(obj)
    _refuse_conflicting_keys(obj, "image", "images")
    _refuse_conflicting_keys(obj, "video", "videos")
    videos = _media_list(obj.get("video", obj.get("videos")), "videos")
    if "conversations" in obj:
        messages = _messages_from(obj["conversations"], "from", "value")
        images = _image_list(obj.get("image", obj.get("images")))
        _refuse_conflicting_keys(obj, "system_prompt", "system")
        system = obj.get("system_prompt", obj.get("system"))
    elif "messages" in obj:
        messages = _messages_from(obj["messages"], "role", "content")
        images = _image_list(obj.get("images", obj.get("image")))
        system = obj.get("system")
    elif "caption" in obj or "text" in obj:
        text = obj["caption"] if "caption" in obj else obj["text"]
        images = _image_list(obj.get("image", obj.get("images")))
        prompt = [("user", IMAGE_TAG * len(images) + VIDEO_TAG * len(videos))] if images or videos else []
        messages = [*prompt, ("assistant", text)]
        system = None
    else:
        raise SampleError("malformed_record", "no 'conversations', 'messages', 'caption' or 'text' field")
    if system is not None:
        if messages and messages[0][0] == "system":
            key = "system_prompt" if "system_prompt" in obj else "system"
            raise SampleError(
                "malformed_record",
                f"record has both a {key!r} field and a system message; keep one of them",
            )
        messages.insert(0, ("system", system))
    raw_id = obj.get("id")
    sample_id = f"{source}:{line}" if raw_id is None or raw_id == "" else str(raw_id)
    conv = Conversation(
        messages=tuple(messages), images=tuple(images), sample_id=sample_id, videos=tuple(videos)
    )
    validate_conversation(conv)
    return conv


def _refuse_unsupported_modalities(obj: dict) -> None:
    """`unsupported_modality` for a record naming a modality of UNSUPPORTED_MODALITIES, by key or by tag."""
    for modality, (keys, tag) in UNSUPPORTED_MODALITIES.items():
        present = [k for k in keys if k in obj]
        if present:
            raise SampleError(
                "unsupported_modality", f"record has a {present[0]!r} field: {modality} is not supported yet"
            )
        for turns_key, content_key in (("conversations", "value"), ("messages", "content")):
            turns = obj.get(turns_key)
            if isinstance(turns, list) and any(
                isinstance(t, dict) and isinstance(t.get(content_key), str) and tag in t[content_key]
                for t in turns
            ):
                raise SampleError(
                    "unsupported_modality", f"record has a {tag} tag: {modality} is not supported yet"
                )


def _refuse_conflicting_keys(obj: dict, a: str, b: str) -> None:
    if a in obj and b in obj:
        raise SampleError("malformed_record", f"record has both {a!r} and {b!r}; keep one of them")


def _messages_from(raw: Any, role_key: str, content_key: str) -> list[tuple[str, str]]:
    if not isinstance(raw, list):
        raise SampleError("malformed_record", f"messages must be a list, got {type(raw).__name__}")
    messages = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict) or role_key not in msg or content_key not in msg:
            raise SampleError("malformed_record", f"message {i} needs '{role_key}' and '{content_key}'")
        role = _ROLE_ALIASES.get(str(msg[role_key]).lower()) if isinstance(msg[role_key], str) else None
        if role is None:
            raise SampleError("unknown_role", f"message {i} has unknown role {msg[role_key]!r}")
        messages.append((role, msg[content_key]))
    return messages


def _image_list(raw: Any) -> list[str]:
    return _media_list(raw, "images")


def _media_list(raw: Any, what: str) -> list[str]:
    if raw is None:
        return []
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(p, str) and p for p in items):
        raise SampleError("malformed_record", f"{what} must be a non-empty string or a list of them")
    return list(items)


def validate_conversation(conv: Conversation) -> None:
    """Raise `SampleError` unless `conv` is a trainable, well-formed conversation."""
    if not conv.messages:
        raise SampleError("empty_conversation", "no messages")
    tags = video_tags = 0
    for i, (role, content) in enumerate(conv.messages):
        if role not in ROLES:
            raise SampleError("unknown_role", f"message {i} has unknown role {role!r}")
        if not isinstance(content, str):
            raise SampleError("malformed_record", f"message {i} content must be a string")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SampleError("malformed_record", f"message {i} is not valid Unicode: {exc}") from None
        if role == "system" and i != 0:
            raise SampleError("misplaced_system", f"system message at position {i}; only the first may be")
        _refuse_reserved(i, content, RESERVED_TOKENS)
        tags += content.count(IMAGE_TAG)
        video_tags += content.count(VIDEO_TAG)
    if not any(role == "assistant" and content.strip() for role, content in conv.messages):
        raise SampleError("no_assistant_turn", "no assistant message with content: nothing to train on")
    if tags != len(conv.images):
        raise SampleError("image_tag_mismatch", f"{tags} <image> tags but {len(conv.images)} images")
    if video_tags != len(conv.videos):
        raise SampleError("video_tag_mismatch", f"{video_tags} <video> tags but {len(conv.videos)} videos")


def refuse_reserved_tokens(conv: Conversation, reserved: Sequence[str]) -> None:
    """SampleError (`reserved_token_in_text`) where a message's text holds a control token of `reserved` (the
    tokenizer would read it as that token: a record could forge turns or media)."""
    for i, (_, content) in enumerate(conv.messages):
        _refuse_reserved(i, content, reserved)


def _refuse_reserved(i: int, content: str, reserved: Sequence[str]) -> None:
    for literal in reserved:
        if literal in content:
            raise SampleError("reserved_token_in_text", f"message {i} contains the control token {literal}")


@dataclass(frozen=True)
class TokenizedSample:
    """Token ids and loss mask of one rendered conversation, plus what truncation needs.

    `turn_boundaries[k]` is the token index just past message k (after its trailing newline);
    `turn_roles[k]` its role and `turn_image_counts[k]` / `turn_video_counts[k]` its numbers of images and
    videos. `image_spans` / `video_spans` are the [start, end) token ranges <|vision_start|> ...
    <|vision_end|> of each image / video, in order.
    """

    input_ids: np.ndarray  # uint32 [n]
    loss_mask: np.ndarray  # uint8 [n]
    num_image_tokens: int
    image_token_counts: tuple[int, ...]
    turn_boundaries: tuple[int, ...]
    turn_roles: tuple[str, ...]
    turn_image_counts: tuple[int, ...]
    image_spans: tuple[tuple[int, int], ...]
    video_token_counts: tuple[int, ...] = ()
    turn_video_counts: tuple[int, ...] = ()
    video_spans: tuple[tuple[int, int], ...] = ()

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_images(self) -> int:
        return len(self.image_token_counts)

    @property
    def num_videos(self) -> int:
        return len(self.video_token_counts)

    @property
    def num_video_tokens(self) -> int:
        return sum(self.video_token_counts)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def _checked_counts(counts: Sequence[int], paths: tuple[str, ...], what: str) -> list[int]:
    if len(counts) != len(paths):
        raise ValueError(f"{len(counts)} {what} token counts for {len(paths)} {what}s")
    if any(int(n) < 1 for n in counts):
        raise ValueError(f"{what} token counts must be >= 1, got {list(counts)}")
    return [int(n) for n in counts]


@dataclass(frozen=True)
class PreparedConversation:
    """A validated conversation rendered with one pad per image / video: what gets encoded (`text`) and what
    `finish_tokenized` needs to turn its token ids and offsets into a `TokenizedSample`."""

    text: str
    rendered: _Rendered
    messages: tuple[tuple[str, str], ...]
    image_token_counts: tuple[int, ...]
    video_token_counts: tuple[int, ...]
    video_expansions: tuple[np.ndarray | None, ...] = ()  # per video: the ids its one pad becomes (or pads)
    # the expansions replace each video's whole <|vision_start|><|video_pad|><|vision_end|>, not its pad
    video_whole_blocks: bool = False
    # per image: the ids its whole placeholder becomes (`ImageStyle.token_ids`), None where its pad is repeated
    image_expansions: tuple[np.ndarray | None, ...] = ()


def prepare_conversation(
    conv: Conversation,
    tokenizer: TextTokenizer,
    image_token_counts: Sequence[int],
    template: ChatTemplate | None = None,
    video_token_counts: Sequence[int] = (),
    video_expansions: Sequence[np.ndarray | None] = (),
    video_whole_blocks: bool = False,
    image_expansions: Sequence[np.ndarray | None] = (),
) -> PreparedConversation:
    """Check `conv` against the media token counts and render it for encoding (ValueError where they differ).
    `video_expansions`: per video the ids its pad becomes (`video_tokens_qwen3.placeholder_ids`), else its pads
    repeated; with `video_whole_blocks`, the ids its whole vision block becomes (`video_tokens_ov2.block_ids`:
    the caller checks that their first text does not merge with the text before, `video_tokens_ov2`).
    `image_expansions`: per image the ids its whole placeholder becomes (`ImageStyle.token_ids`, Gemma 4's
    `<|image>` N x `<|image|>` `<image|>`), else its pad repeated."""
    counts = _checked_counts(image_token_counts, conv.images, "image")
    if image_expansions and len(image_expansions) != len(counts):
        raise ValueError(f"{len(image_expansions)} image expansions for {len(counts)} images")
    video_counts = _checked_counts(video_token_counts, conv.videos, "video")
    if video_expansions and len(video_expansions) != len(video_counts):
        raise ValueError(f"{len(video_expansions)} video expansions for {len(video_counts)} videos")
    refuse_reserved_tokens(conv, tokenizer.controls.literals)  # the scan refused Qwen's; these are the rules'
    if video_counts and "video_pad" not in tokenizer.special_ids:
        raise ValueError(
            f"tokenizer {tokenizer.name} has no {VIDEO_PAD} token, needed for videos; use a "
            "Qwen2-VL/Qwen2.5-VL/Qwen3-style tokenizer.json"
        )
    template = template or ChatTemplate()
    messages = template.with_default_system(conv)
    for tag, n in ((IMAGE_TAG, len(counts)), (VIDEO_TAG, len(video_counts))):
        if sum(content.count(tag) for _, content in messages) != n:
            raise ValueError(f"the messages hold another number of {tag} tags than the {n} given")
    # Encode with one pad per image / video and repeat it afterwards: special tokens are split out before
    # the model's pre-tokenizer runs, so the ids are those of the fully expanded text, at a fraction of the
    # cost for large images (thousands of pads each).
    rendered = template.render(messages, [1] * len(counts), [1] * len(video_counts))
    return PreparedConversation(
        rendered.text, rendered, tuple(messages), tuple(counts), tuple(video_counts), tuple(video_expansions),
        video_whole_blocks, tuple(image_expansions),
    )  # fmt: skip


def encode_texts(tokenizer: TextTokenizer, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token ids (uint32 [n]) and character offsets (int64 [n, 2]) of each text, in one batch call where the
    tokenizer has one (`encode_batch_arrays`), else text by text."""
    batch = getattr(tokenizer, "encode_batch_arrays", None)
    if batch is not None:
        return list(batch(texts))
    out = []
    for text in texts:
        ids, offsets = tokenizer.encode_with_offsets(text)
        out.append((np.asarray(ids, dtype=np.uint32), np.asarray(offsets, dtype=np.int64).reshape(-1, 2)))
    return out


def finish_tokenized(
    preps: Sequence[PreparedConversation],
    tokenizer: TextTokenizer,
    encoded: Sequence[tuple[np.ndarray, np.ndarray]],
) -> Iterator[TokenizedSample]:
    """The `TokenizedSample` of each prepared conversation from the ids and offsets of its encoded `text`
    (`encode_texts`), in order; an error is raised at the conversation that causes it.

    Offsets of a left-to-right tokenizer never go back, so the tokens overlapping a character span are one
    contiguous run found by binary search: the loss masks and turn boundaries of the whole batch come from
    a few array operations over the batch's tokens laid end to end (each text's characters shifted past the
    previous one's, one character apart, so no span reaches into a neighbour). Offsets that go back (another
    kind of tokenizer) take the elementwise test, conversation by conversation.
    """
    if len(preps) != len(encoded):
        raise ValueError(f"{len(encoded)} encodings for {len(preps)} conversations")
    if not preps:
        return
    sizes = np.array([len(ids) for ids, _ in encoded], dtype=np.int64)
    first_token = np.zeros(len(preps) + 1, dtype=np.int64)
    np.cumsum(sizes, out=first_token[1:])
    char_base = np.zeros(len(preps), dtype=np.int64)
    np.cumsum([len(prep.text) + 1 for prep in preps[:-1]], out=char_base[1:])
    spans = np.concatenate([off for _, off in encoded]).reshape(-1, 2) + np.repeat(char_base, sizes)[:, None]
    starts, ends = spans.T.copy()
    n = len(starts)
    in_order = n < 2 or bool((np.diff(starts) >= 0).all() and (np.diff(ends) >= 0).all())
    loss_all = boundaries_all = None
    if in_order:
        shift = [int(c) for c in char_base]
        targets = np.array(
            [(a + c, b + c) for prep, c in zip(preps, shift) for a, b in prep.rendered.target_spans],
            dtype=np.int64,
        ).reshape(-1, 2)
        lo = np.searchsorted(ends, targets[:, 0], "right")  # first token with end > a
        hi = np.searchsorted(starts, targets[:, 1], "left")  # past the last token with start < b
        keep = lo < hi
        depth = np.bincount(lo[keep], minlength=n + 1) - np.bincount(hi[keep], minlength=n + 1)
        loss_all = (np.cumsum(depth[:n]) > 0).astype(np.uint8)
        ends_of_messages = np.array(
            [e + c for prep, c in zip(preps, shift) for e in prep.rendered.message_ends], dtype=np.int64
        )
        boundaries_all = np.searchsorted(starts, ends_of_messages, "left")
    n_messages = 0
    for k, (prep, (ids, offsets)) in enumerate(zip(preps, encoded)):
        t0, t1 = int(first_token[k]), int(first_token[k + 1])
        m = len(prep.rendered.message_ends)
        if loss_all is not None and boundaries_all is not None:
            loss = loss_all[t0:t1].copy()
            boundaries = boundaries_all[n_messages : n_messages + m] - t0
        else:
            loss, boundaries = None, None
        n_messages += m
        yield _finish_one(prep, tokenizer, ids, offsets[:, 0], offsets[:, 1], in_order, loss, boundaries)


def _finish_one(
    prep: PreparedConversation,
    tokenizer: TextTokenizer,
    compact_ids: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    in_order: bool,
    loss: np.ndarray | None,
    boundaries: np.ndarray | None,
) -> TokenizedSample:
    rendered = prep.rendered
    n = len(compact_ids)
    if loss is None:
        loss = np.zeros(n, dtype=np.uint8)
        for a, b in rendered.target_spans:
            loss[(starts < b) & (ends > a)] = 1
    if boundaries is None:
        boundaries = np.searchsorted(starts, np.asarray(rendered.message_ends, dtype=np.int64), side="left")
    new_index = None  # compact token index -> index in the expanded sequence, where media expand
    compact_spans: dict[str, list[tuple[int, int]]] = {IMAGE_TAG: [], VIDEO_TAG: []}
    if rendered.media_char_spans:
        repeats = np.ones(n, dtype=np.int64)
        n_of = {IMAGE_TAG: iter(prep.image_token_counts), VIDEO_TAG: iter(prep.video_token_counts)}
        expansions = {
            VIDEO_TAG: iter(prep.video_expansions or [None] * len(prep.video_token_counts)),
            IMAGE_TAG: iter(prep.image_expansions or [None] * len(prep.image_token_counts)),
        }
        replaced: list[tuple[int, np.ndarray]] = []  # (compact index, ids it becomes)
        for tag, a, b in rendered.media_char_spans:
            expected = _placeholder_ids(tokenizer, tag, prep.text[a:b])
            if in_order:  # tokens with start >= a and end <= b
                inside = np.arange(np.searchsorted(starts, a, "left"), np.searchsorted(ends, b, "right"))
            else:
                inside = np.flatnonzero((starts >= a) & (ends <= b))
            if compact_ids[inside].tolist() != expected:
                raise ValueError(
                    f"tokenizer {tokenizer.name} does not keep the vision tokens as single tokens"
                )
            loss[inside] = 0
            expansion = next(expansions[tag])
            whole = expansion is not None and (tag == IMAGE_TAG or prep.video_whole_blocks)
            if len(inside) != 3 and not whole:  # only a vision block's middle pad is repeated
                raise ValueError(
                    f"the chat template writes {prep.text[a:b]} for a {tag}, which only a rule that expands it "
                    "whole takes (a Gemma 4 model folder's)"
                )
            count = next(n_of[tag])
            if len(inside) == 3:
                repeats[inside[1]] = count
            if expansion is not None:
                at_k = int(inside[1]) if len(inside) == 3 else int(inside[0])
                if whole:
                    repeats[inside], at_k = 0, int(inside[0])
                repeats[at_k] = len(expansion)
                replaced.append((at_k, expansion))
            compact_spans[tag].append((int(inside[0]), int(inside[-1]) + 1))
        new_index = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(repeats, out=new_index[1:])
        compact_ids, loss = np.repeat(compact_ids, repeats), np.repeat(loss, repeats)
        for k, ids in replaced:
            compact_ids[new_index[k] : new_index[k + 1]] = ids

    def at(k: int) -> int:
        return int(k) if new_index is None else int(new_index[k])

    messages = prep.messages
    return TokenizedSample(
        input_ids=compact_ids,
        loss_mask=loss,
        num_image_tokens=sum(prep.image_token_counts),
        image_token_counts=prep.image_token_counts,
        turn_boundaries=tuple(at(k) for k in boundaries),
        turn_roles=tuple(role for role, _ in messages),
        turn_image_counts=tuple(content.count(IMAGE_TAG) for _, content in messages),
        image_spans=tuple((at(a), at(b)) for a, b in compact_spans[IMAGE_TAG]),
        video_token_counts=prep.video_token_counts,
        turn_video_counts=tuple(content.count(VIDEO_TAG) for _, content in messages),
        video_spans=tuple((at(a), at(b)) for a, b in compact_spans[VIDEO_TAG]),
    )


def _placeholder_ids(tokenizer: TextTokenizer, tag: str, literal: str) -> list[int]:
    """The ids a media placeholder the template wrote must have: Qwen-VL's vision block as its three control
    tokens, another form (`jinja_chat.MEDIA_FORMS`: Gemma 4's `<|image|>`) as the one token the tokenizer has
    for it."""
    if literal == MEDIA_FORMS[tag][0]:
        pad = "image_pad" if tag == IMAGE_TAG else "video_pad"
        return [tokenizer.special_ids[k] for k in ("vision_start", pad, "vision_end")]
    ids = tokenizer.encode(literal)
    if len(ids) != 1:
        raise ValueError(f"tokenizer {tokenizer.name} does not encode {literal} as one token")
    return [int(ids[0])]


def tokenize_conversation(
    conv: Conversation,
    tokenizer: TextTokenizer,
    image_token_counts: Sequence[int],
    template: ChatTemplate | None = None,
    video_token_counts: Sequence[int] = (),
) -> TokenizedSample:
    """Render `conv`, encode it once, and mark as targets the tokens of assistant content + closing <|im_end|>.

    A token is a target when its character span overlaps assistant content (so a token that straddles the
    header newline and the first content characters is predicted, as the content needs it) or is the
    <|im_end|> closing an assistant message; image and video tokens are never targets. Many conversations:
    `prepare_conversation` each, `encode_texts` their texts in one batch, `finish_tokenized` each.
    """
    prep = prepare_conversation(conv, tokenizer, image_token_counts, template, video_token_counts)
    [sample] = finish_tokenized([prep], tokenizer, encode_texts(tokenizer, [prep.text]))
    return sample


def truncate_sample(tokenized: TokenizedSample, max_len: int) -> TokenizedSample | None:
    """The `truncate` policy: `tokenized` cut to at most `max_len` tokens, or None if no useful cut exists.

    First whole trailing turns are dropped: the result ends after the last assistant message that fits.
    If not even the first assistant message fits, the text is cut at a token boundary, provided the cut is
    outside every image and video span and keeps at least one loss token. Images and videos after the cut
    are dropped with their messages: the kept ones are the first `result.num_images` / `result.num_videos`.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if len(tokenized) <= max_len:
        return tokenized
    cut = 0
    for k, (role, end) in enumerate(zip(tokenized.turn_roles, tokenized.turn_boundaries)):
        if end > max_len:
            break
        if role == "assistant" and tokenized.loss_mask[:end].any():
            cut = k + 1
    if cut > 0:
        end = tokenized.turn_boundaries[cut - 1]
        return _prefix(tokenized, end, cut)
    media_spans = (*tokenized.image_spans, *tokenized.video_spans)
    if any(a < max_len < b for a, b in media_spans) or not tokenized.loss_mask[:max_len].any():
        return None
    turns = sum(1 for b in tokenized.turn_boundaries if b <= max_len) + 1
    return _prefix(tokenized, max_len, min(turns, len(tokenized.turn_roles)))


def _kept_per_turn(per_turn: tuple[int, ...], turns: int, kept: int) -> tuple[int, ...]:
    counts = list(per_turn[:turns])
    if not counts:
        return ()
    counts[-1] = kept - sum(counts[:-1])  # a cut last turn loses its later media
    return tuple(counts)


def _prefix(t: TokenizedSample, end: int, turns: int) -> TokenizedSample:
    kept_spans = tuple(s for s in t.image_spans if s[1] <= end)
    kept_videos = tuple(s for s in t.video_spans if s[1] <= end)
    counts = t.image_token_counts[: len(kept_spans)]
    return replace(
        t,
        input_ids=t.input_ids[:end].copy(),
        loss_mask=t.loss_mask[:end].copy(),
        num_image_tokens=int(sum(counts)),
        image_token_counts=counts,
        turn_boundaries=tuple(min(b, end) for b in t.turn_boundaries[:turns]),
        turn_roles=t.turn_roles[:turns],
        turn_image_counts=_kept_per_turn(t.turn_image_counts, turns, len(kept_spans)),
        image_spans=kept_spans,
        video_token_counts=t.video_token_counts[: len(kept_videos)],
        turn_video_counts=_kept_per_turn(t.turn_video_counts, turns, len(kept_videos)),
        video_spans=kept_videos,
    )
