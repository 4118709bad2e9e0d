"""Token ids to the text the page shows, one token at a time, special tokens as their literal."""

from __future__ import annotations

import hashlib
from typing import Any

from mmpack.packing.tokenizer import (
    BYTE_TOKENIZER,
    SPECIAL_TOKENS,
    VIDEO_PAD,
    resolve_tokenizer_file,
)


class TokenDecoder:
    """Decodes single token ids with the dataset's tokenizer (a `tokenizer.json`, its folder, or the byte-level
    demo tokenizer); without one, every token shows as its id."""

    def __init__(self, path: str | None, manifest_tokenizer: dict[str, Any] | None = None) -> None:
        info = manifest_tokenizer or {}
        self.problems: list[str] = []
        self._tok: Any = None
        self._byte = False
        self._special: set[int] = set(int(v) for v in (info.get("special_ids") or {}).values())
        self._cache: dict[int, str] = {}
        if path is None and info.get("is_fallback"):
            path = BYTE_TOKENIZER
        if path is None:
            self.problems.append(
                "no tokenizer given: tokens show as their ids; pass -t TOKENIZER (the tokenizer.json the dataset "
                f"was packed with, {info.get('name', '?')!r})"
            )
        elif str(path) == BYTE_TOKENIZER:
            self._byte = True
            literals = [*SPECIAL_TOKENS.values(), VIDEO_PAD]
            self._byte_special = {256 + i: lit for i, lit in enumerate(literals)}
            self._special |= set(self._byte_special)
        else:
            self._load(str(path), info)

    def _load(self, path: str, info: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        file = resolve_tokenizer_file(path)
        data = file.read_bytes()
        self._tok = Tokenizer.from_str(data.decode("utf-8"))
        want = info.get("sha256")
        if want and hashlib.sha256(data).hexdigest() != want:
            self.problems.append(
                f"tokenizer {file} is not the one the dataset was packed with (sha256 differs from the "
                "manifest's): the text shown may be wrong; pass the packing tokenizer with -t"
            )
        for tid, added in self._tok.get_added_tokens_decoder().items():
            if added.special:
                self._special.add(int(tid))

    def piece(self, token_id: int) -> str:
        """The text of one token (special tokens as their literal, e.g. `<|im_start|>`)."""
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode(token_id)
        return text

    def _decode(self, token_id: int) -> str:
        if self._byte:
            if token_id in self._byte_special:
                return self._byte_special[token_id]
            return chr(token_id) if token_id < 128 else f"\\x{token_id:02x}"
        if self._tok is None:
            return f"[{token_id}]"
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if text and "\ufffd" not in text:
            return str(text)
        raw = self._tok.id_to_token(token_id)  # part of a multi-byte character: show the token itself
        return str(raw) if raw is not None else f"[{token_id}]"

    def is_special(self, token_id: int) -> bool:
        """True for the tokenizer's special (control) tokens."""
        return token_id in self._special
