"""Text tokenizers for the length model: a wrapper over HF `tokenizers` and a byte-level demo tokenizer.

Both expose the same small interface (`TextTokenizer`): `encode`, `encode_with_offsets` (character offsets
into the input string), `special_ids` (pad, im_start, im_end, vision_start, vision_end, image_pad, and
video_pad where the tokenizer has it: only datasets with videos need it),
`vocab_size`, `name`, `sha256` and `is_fallback`. Special tokens are always parsed out of the text (so the
rendered chat string can be encoded in one call) and no BOS/EOS is added.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

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
# Control tokens that may not appear in a record's text.
RESERVED_TOKENS: tuple[str, ...] = (*SPECIAL_TOKENS.values(), VIDEO_PAD)
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

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens parsed, nothing added."""
        ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and, per token, the (start, end) character span of `text` it came from."""
        ...


class HFTokenizer:
    """A `tokenizer.json` (HF `tokenizers`) with the Qwen-style chat control tokens.

    Raises:
        FileNotFoundError: no `tokenizer.json` at `path`.
        ValueError: the file is not a valid tokenizer, or lacks one of the control tokens.
    """

    is_fallback = False

    def __init__(self, path: str | Path):
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
        self.special_ids = self._find_special_ids()

    def _find_special_ids(self) -> dict[str, int]:
        ids: dict[str, int] = {}
        for role, literal in SPECIAL_TOKENS.items():
            token_id = self._tok.token_to_id(literal)
            if token_id is None:
                raise ValueError(
                    f"tokenizer {self.path} has no {literal} token (needed as the {role} token); "
                    "use a Qwen2/Qwen2.5/Qwen3-style tokenizer.json"
                )
            # Must be an added token, or the rendered text would split it into pieces.
            if self.encode(literal) != [token_id]:
                raise ValueError(
                    f"tokenizer {self.path} does not encode {literal} as the single token {token_id}; "
                    "it must be an added (special) token"
                )
            ids[role] = int(token_id)
        video_pad = self._tok.token_to_id(VIDEO_PAD)
        if video_pad is not None and self.encode(VIDEO_PAD) == [video_pad]:
            ids["video_pad"] = int(video_pad)
        return ids

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

    def __init__(self) -> None:
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


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """The tokenizer at `path` (a `tokenizer.json` or its folder); `BYTE_TOKENIZER` gives the byte-level demo one.

    Raises:
        ValueError: `path` is None or empty (there is no default tokenizer).
    """
    if path is None or str(path) == "":
        raise ValueError(f"no tokenizer given: pass a tokenizer.json or its folder (or {BYTE_TOKENIZER!r})")
    if str(path) == BYTE_TOKENIZER:
        return ByteTokenizer()
    return HFTokenizer(path)


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
