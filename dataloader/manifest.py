"""The manifest of a packed dataset, as the loader needs it."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from packing.format import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME
from packing.image_tokens import ImageTokenRule


@dataclass(frozen=True)
class ShardInfo:
    """One shard file: its path relative to the dataset root and the global bins it holds."""

    path: str
    format: str
    first_bin: int
    bins: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """The parts of manifest.json the loader uses, plus the raw dict."""

    seq_len: int
    num_bins: int
    shards: tuple[ShardInfo, ...]
    pad_id: int
    image_pad_id: int
    image_rule: ImageTokenRule
    fingerprint: str
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def patch_size(self) -> int:
        return self.image_rule.patch_size

    @property
    def merge_size(self) -> int:
        return self.image_rule.merge_size

    @cached_property
    def shard_first_bins(self) -> np.ndarray:
        """First global bin of each shard (computed once: `shard_of_bin` runs for every bin read)."""
        return np.array([s.first_bin for s in self.shards], dtype=np.int64)

    def shard_of_bin(self, bins: np.ndarray) -> np.ndarray:
        """Index (into `shards`) of the shard holding each global bin id."""
        return np.searchsorted(self.shard_first_bins, np.asarray(bins, dtype=np.int64), side="right") - 1

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, shard_format: str | None = None) -> Manifest:
        """Validates a parsed manifest.json and keeps the shards of one format (arrow preferred)."""
        if raw.get("format") != FORMAT_NAME:
            raise ValueError(f"not an mmpack packed dataset manifest (format={raw.get('format')!r})")
        if raw.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"unsupported packed format version {raw.get('version')} (want {FORMAT_VERSION})"
            )
        all_shards = [ShardInfo(**{k: s[k] for k in ShardInfo.__dataclass_fields__}) for s in raw["shards"]]
        formats = sorted({s.format for s in all_shards})
        if shard_format is None:
            shard_format = "arrow" if "arrow" in formats else (formats[0] if formats else "arrow")
        shards = tuple(sorted((s for s in all_shards if s.format == shard_format), key=lambda s: s.first_bin))
        if not shards and all_shards:
            raise ValueError(f"dataset has no {shard_format!r} shards (has {formats})")
        expected = 0
        for s in shards:
            if s.first_bin != expected or s.bins < 0:
                raise ValueError(f"shard {s.path} starts at bin {s.first_bin}, expected {expected}")
            expected += s.bins
        specials = raw.get("tokenizer", {}).get("special_ids", {})
        rule = raw.get("image_rule") or {}
        canon = json.dumps(
            {"seq_len": raw["seq_len"], "shards": [(s.path, s.bins, s.sha256) for s in shards]},
            sort_keys=True,
        )
        return cls(
            seq_len=int(raw["seq_len"]),
            num_bins=expected,
            shards=shards,
            pad_id=int(specials.get("pad", 0)),
            image_pad_id=int(specials.get("image_pad", -1)),
            image_rule=ImageTokenRule(
                **{k: v for k, v in rule.items() if k in ImageTokenRule.__dataclass_fields__}
            ),
            fingerprint=hashlib.sha256(canon.encode()).hexdigest()[:16],
            raw=raw,
        )


def join_url(root: str, rel: str) -> str:
    """Joins a dataset root (path or URL) and a relative path with '/'."""
    return root.rstrip("/") + "/" + rel.lstrip("/")


def load_manifest(
    root: str,
    *,
    storage_options: dict[str, Any] | None = None,
    shard_format: str | None = None,
    max_attempts: int = 6,
) -> Manifest:
    """Reads `<root>/manifest.json` through fsspec."""
    from fsspec.core import url_to_fs

    from dataloader.storage import resolve_storage_options

    url = join_url(root, MANIFEST_NAME)
    fs, fs_path = url_to_fs(url, **resolve_storage_options(url, storage_options))
    for attempt in range(max_attempts):
        try:
            raw = json.loads(fs.cat_file(fs_path))
            break
        except FileNotFoundError as e:
            raise FileNotFoundError(f"no packed dataset at {root!r}: {url} not found") from e
        except Exception as e:  # transient network errors and truncated bodies: retry with backoff
            if attempt == max_attempts - 1:
                raise OSError(
                    f"cannot read {url} after {max_attempts} attempts: {type(e).__name__}: {e}"
                ) from e
            time.sleep(min(4.0, 0.1 * 2**attempt))
    return Manifest.from_dict(raw, shard_format=shard_format)
