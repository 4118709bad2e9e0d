"""Text tokenizers for the length model: a wrapper over HF `tokenizers` and a byte-level demo tokenizer.

Both expose the same small interface (`TextTokenizer`): `encode`, `encode_with_offsets` (character offsets
into the input string), `special_ids` (role -> id of the control tokens its `controls` name),
`vocab_size`, `name`, `sha256` and `is_fallback`. Special tokens are always parsed out of the text (so the
rendered chat string can be encoded in one call) and no BOS/EOS is added.

Which control tokens a tokenizer must have depends on the model's rules (`ControlTokens`, owned by each image and
video style: `ImageStyle.control_tokens`, `VideoStyle.control_tokens`): Qwen's (`QWEN_TOKENS`: pad, im_start,
im_end, vision_start, vision_end, image_pad, and video_pad where the tokenizer has it: only datasets with videos
need it) by default, Gemma 4's for its rules. The same set is what a record's text may not hold.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

# Role of each control token in the rendered chat text -> its literal string.
SPECIAL_TOKENS: dict[str, str] = {
    "pad": "<|endoftext|>",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
    "image_pad": "<|image_pad|>",
}
# The video pad: optional, since a tokenizer for image and text data need not have it.
VIDEO_PAD = "<|video_pad|>"


@dataclass(frozen=True)
class ControlTokens:
    """The control tokens a model's text needs from its tokenizer, as (role, literal) pairs: `required` ones
    (refused where missing), `optional` ones (recorded where the tokenizer has them). A role says what the packer
    and loader use a token for ("image_pad": the token repeated per image token, "pad": bin padding); `name`
    says whose tokens they are, in messages. Every literal is reserved: a record's text may not hold it."""

    name: str
    required: tuple[tuple[str, str], ...]
    optional: tuple[tuple[str, str], ...] = ()

    @property
    def literals(self) -> tuple[str, ...]:
        """Every literal, required first: what a record's text may not hold."""
        return tuple(literal for _, literal in (*self.required, *self.optional))

    def merged(self, other: ControlTokens) -> ControlTokens:
        """Both sets' tokens (a role required by either is required); ValueError where they name one role
        differently (rules of two models)."""
        ours = dict((*self.optional, *self.required))
        for role, literal in (*other.required, *other.optional):
            if ours.get(role, literal) != literal:
                raise ValueError(
                    f"the {self.name} and {other.name} rules need different {role} tokens ({ours[role]} vs "
                    f"{literal}): take the image and video rules from one model folder (--model DIR)"
                )
        required = dict((*self.required, *other.required))
        optional = {r: v for r, v in (*self.optional, *other.optional) if r not in required}
        if set(required.items()) == set(self.required) and set(optional.items()) == set(self.optional):
            return self  # nothing new (Gemma 4's video tokens beside its image tokens)
        return ControlTokens(f"{self.name} + {other.name}", tuple(required.items()), tuple(optional.items()))


# The Qwen-VL chat and vision tokens: the default rules' (`qwen2_vl` images, the Qwen-VL video rules).
QWEN_TOKENS = ControlTokens("Qwen", tuple(SPECIAL_TOKENS.items()), (("video_pad", VIDEO_PAD),))
# Control tokens that may not appear in a record's text, whatever its rules (the scan refuses them).
RESERVED_TOKENS: tuple[str, ...] = QWEN_TOKENS.literals
TOKENIZER_FILE = "tokenizer.json"
# The name that asks for the byte-level demo tokenizer (never chosen for want of another).
BYTE_TOKENIZER = "byte-fallback"


@runtime_checkable
class TextTokenizer(Protocol):
    """What the length model needs from a tokenizer."""

    name: str
    sha256: str
    is_fallback: bool
    vocab_size: int
    special_ids: dict[str, int]
    controls: ControlTokens  # the control tokens it was checked for: `special_ids` holds their ids

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens parsed, nothing added."""
        ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and, per token, the (start, end) character span of `text` it came from."""
        ...


class HFTokenizer:
    """A `tokenizer.json` (HF `tokenizers`) with the control tokens `controls` (Qwen's by default).

    Raises:
        FileNotFoundError: no `tokenizer.json` at `path`.
        ValueError: the file is not a valid tokenizer, or lacks required control tokens (one line naming
            the file and every missing token).
    """

    is_fallback = False

    def __init__(self, path: str | Path, controls: ControlTokens = QWEN_TOKENS):
        from tokenizers import Tokenizer

        file = resolve_tokenizer_file(path)
        data = file.read_bytes()
        try:
            self._tok = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON/schema
            raise ValueError(f"{file} is not a valid HF tokenizers file: {exc}") from exc
        self.path = file
        self.name = file.parent.name or file.name
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.controls = controls
        self.special_ids = self._find_special_ids(controls)

    def _find_special_ids(self, controls: ControlTokens) -> dict[str, int]:
        ids: dict[str, int] = {}
        missing = []
        for role, literal in controls.required:
            token_id = self._single_id(literal)
            if token_id is None:
                missing.append(literal)
            else:
                ids[role] = token_id
        if missing:
            raise ValueError(
                f"tokenizer {self.path} lacks the {controls.name} control tokens {' '.join(missing)} (each must be "
                "one added token); pack with the model's own tokenizer.json (--model DIR or -t)"
            )
        optional = {role: self._single_id(literal) for role, literal in controls.optional}
        return ids | {role: i for role, i in optional.items() if i is not None}

    def _single_id(self, literal: str) -> int | None:
        """The id of `literal` where the tokenizer has it as one added token (else the rendered text would
        split it into pieces), else None."""
        token_id = self._tok.token_to_id(literal)
        if token_id is None or self.encode(literal) != [token_id]:
            return None
        return int(token_id)

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of a text one token stands for (`token_chars_bound`); None where none holds."""
        return token_chars_bound(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [(int(a), int(b)) for a, b in enc.offsets]

    def encode_batch_arrays(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """`encode_with_offsets` of many texts in one call: per text, ids (uint32 [n]) and offsets (int64 [n, 2])."""
        out = []
        for enc in self._tok.encode_batch(list(texts), add_special_tokens=False):
            ids = np.array(enc.ids, dtype=np.uint32)
            out.append((ids, np.array(enc.offsets, dtype=np.int64).reshape(len(ids), 2)))
        return out

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


class ByteTokenizer:
    """Byte-level tokenizer for demos and tests (`-t byte-fallback`): ids 0..255 are UTF-8 bytes, 256..262 the
    control tokens (262: video pad).

    Token counts are far from a real model's; the manifest records `is_fallback` so nobody mistakes it.
    """

    is_fallback = True
    name = "byte-fallback"
    sha256 = ""
    vocab_size = 256 + len(SPECIAL_TOKENS) + 1
    controls = QWEN_TOKENS

    def __init__(self, controls: ControlTokens = QWEN_TOKENS) -> None:
        if controls != QWEN_TOKENS:
            raise ValueError(
                f"the {BYTE_TOKENIZER} tokenizer has Qwen's control tokens only, not the {controls.name} ones; "
                "pack with the model's own tokenizer.json (--model DIR or -t)"
            )
        literals = {**SPECIAL_TOKENS, "video_pad": VIDEO_PAD}
        self.special_ids = {role: 256 + i for i, role in enumerate(literals)}
        self.max_token_chars = max(len(literal) for literal in literals.values())  # a byte token: 1 character
        self._literal_to_id = {literals[role]: tid for role, tid in self.special_ids.items()}

    def encode(self, text: str) -> list[int]:
        return self.encode_with_offsets(text)[0]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        pos = 0
        while pos < len(text):
            literal = self._special_at(text, pos)
            if literal is not None:
                ids.append(self._literal_to_id[literal])
                offsets.append((pos, pos + len(literal)))
                pos += len(literal)
                continue
            for byte in text[pos].encode("utf-8"):
                ids.append(byte)
                offsets.append((pos, pos + 1))
            pos += 1
        return ids, offsets

    def _special_at(self, text: str, pos: int) -> str | None:
        if text[pos] != "<":
            return None
        for literal in self._literal_to_id:
            if text.startswith(literal, pos):
                return literal
        return None

    def __repr__(self) -> str:
        return "ByteTokenizer()"


# What a `tokenizers` pipeline may do for `token_chars_bound` to hold: normalizers and pre-tokenizers that keep
# every character of the text (in some token), and a BPE model that gives an unknown character its own token.
_KEEPING_NORMALIZERS = frozenset(
    {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace", "Sequence"}
)
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Split", "Digits", "Punctuation", "Metaspace", "UnicodeScripts", "Sequence"}
)
# Canonical composition merges at most this many code points into one (U+1F82: alpha and three marks).
_COMPOSED_CHARS = 4


def token_chars_bound(tok: object) -> int | None:
    """An upper bound on the characters of a text that one token of the HF `tokenizers.Tokenizer` `tok` stands
    for (its longest vocabulary entry, times what a normalizer can compose into one character), so that a text
    of more than `n` times it holds more than `n` tokens; None where the pipeline may drop characters or fuse a
    run of unknown ones into one token (then no such bound holds)."""
    model = tok.model  # type: ignore[attr-defined]
    if type(model).__name__ != "BPE" or getattr(model, "fuse_unk", False):
        return None
    parts = (
        (tok.normalizer, "normalizers", _KEEPING_NORMALIZERS),  # type: ignore[attr-defined]
        (tok.pre_tokenizer, "pretokenizers", _KEEPING_PRE_TOKENIZERS),  # type: ignore[attr-defined]
    )
    for part, members, keeping in parts:
        if part is not None and not _keeps_characters(json.loads(part.__getstate__()), members, keeping):
            return None
    vocab = tok.get_vocab(with_added_tokens=True)  # type: ignore[attr-defined]
    return _COMPOSED_CHARS * max(map(len, vocab), default=1)


def _keeps_characters(config: dict, members: str, keeping: frozenset[str]) -> bool:
    """Whether a normalizer's or pre-tokenizer's JSON config keeps every character (recursing into Sequence)."""
    kind = config.get("type")
    if kind not in keeping:
        return False
    if kind == "Sequence":
        return all(_keeps_characters(c, members, keeping) for c in config.get(members, ()))
    if kind == "Replace" and not config.get("content"):
        return False  # a replacement by nothing drops characters
    return not (kind == "Split" and config.get("behavior") == "Removed")


def resolve_tokenizer_file(path: str | Path) -> Path:
    """`path` itself if it is a file, else `path/tokenizer.json`; FileNotFoundError if neither exists."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if not p.is_file():
        raise FileNotFoundError(
            f"no tokenizer at {path}: expected a {TOKENIZER_FILE} file or a folder holding one"
        )
    return p


def load_tokenizer(path: str | Path, controls: ControlTokens = QWEN_TOKENS) -> TextTokenizer:
    """The tokenizer at `path` (a `tokenizer.json` or its folder), checked for the control tokens `controls`
    (`control_tokens_of` the job's rules); `BYTE_TOKENIZER` gives the byte-level demo one.

    Raises:
        ValueError: `path` is None or empty (there is no default tokenizer), or the tokenizer lacks a required
            control token.
    """
    if path is None or str(path) == "":
        raise ValueError(f"no tokenizer given: pass a tokenizer.json or its folder (or {BYTE_TOKENIZER!r})")
    if str(path) == BYTE_TOKENIZER:
        return ByteTokenizer(controls)
    return HFTokenizer(path, controls)


def control_tokens_of(image_rule: Any, video_rule: Any | None = None) -> ControlTokens:
    """The control tokens a tokenizer needs for an `ImageTokenRule` and a `VideoTokenRule`: its image style's,
    with its video style's where that has its own (ValueError where the two name one role differently)."""
    tokens: ControlTokens = image_rule.kind.control_tokens
    extra = None if video_rule is None else video_rule.kind.control_tokens
    return tokens if extra is None else tokens.merged(extra)


def tokenizer_files(path: str) -> list[str]:
    """The file a tokenizer is read from (none for the byte-level demo one): what a rerun's identity covers."""
    return [] if path == BYTE_TOKENIZER else [str(resolve_tokenizer_file(path))]


def tokenizer_info(tokenizer: TextTokenizer) -> dict[str, object]:
    """The manifest's "tokenizer" entry."""
    return {
        "name": tokenizer.name,
        "sha256": tokenizer.sha256,
        "is_fallback": tokenizer.is_fallback,
        "vocab_size": tokenizer.vocab_size,
        "special_ids": dict(tokenizer.special_ids),
    }
