"""The manifest of a packed dataset, as the loader needs it: the shards of one format, in bin order.

The file's model (records, version rule, shard-path checks) is `mmpack.packing.manifest.Manifest`; this module only
reads the bytes (fsspec, with retries) and keeps the loader's view of them.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from mmpack.packing.errors import MmpackError
from mmpack.packing.fileio import resolve_storage_options
from mmpack.packing.format import MANIFEST_NAME
from mmpack.packing.image_tokens import ImageTokenRule
from mmpack.packing.manifest import Manifest as DatasetManifest
from mmpack.packing.manifest import ManifestError, ShardEntry
from mmpack.packing.retry import RetriesExhausted, RetryPolicy, is_transient, retry_call

ShardInfo = ShardEntry  # one shard file: its path relative to the dataset root and the global bins it holds

__all__ = ["Manifest", "ManifestError", "ShardInfo", "join_url", "load_manifest"]


@dataclass(frozen=True)
class Manifest:
    """The loader's view of a dataset: the shards of one format, ids and the image rule it decodes with."""

    seq_len: int
    num_bins: int
    shards: tuple[ShardInfo, ...]
    pad_id: int
    image_pad_id: int
    image_rule: ImageTokenRule
    max_image_pixels: int  # images larger than this are refused before decoding
    fingerprint: str
    dataset: DatasetManifest = field(repr=False, compare=False)
    video_pad_id: int = -1  # -1: the dataset's tokenizer has no <|video_pad|> (no videos)

    @property
    def raw(self) -> dict[str, Any]:
        """The whole manifest as plain JSON values."""
        return self.dataset.to_dict()

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

    @cached_property
    def _first_bin_list(self) -> list[int]:
        return self.shard_first_bins.tolist()

    def shard_index(self, bin_id: int) -> int:
        """`shard_of_bin` of one bin (no array made: it runs for every bin a worker reads)."""
        return bisect.bisect_right(self._first_bin_list, bin_id) - 1

    def shard_of_bin(self, bins: np.ndarray) -> np.ndarray:
        """Index (into `shards`) of the shard holding each global bin id."""
        return np.searchsorted(self.shard_first_bins, np.asarray(bins, dtype=np.int64), side="right") - 1

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], *, shard_format: str | None = None, source: str = "manifest.json"
    ) -> Manifest:
        """Validates a parsed manifest.json and keeps the shards of one format (arrow preferred)."""
        return cls.from_model(DatasetManifest.from_dict(raw, source=source), shard_format=shard_format)

    @classmethod
    def from_model(cls, dataset: DatasetManifest, *, shard_format: str | None = None) -> Manifest:
        """The loader's view of a checked manifest."""
        shard_format = shard_format or dataset.default_format()
        shards = dataset.shards_of(shard_format)
        if not shards and dataset.shards:
            raise ManifestError(f"dataset has no {shard_format!r} shards (has {dataset.shard_formats})")
        canon = json.dumps(
            {"seq_len": dataset.seq_len, "shards": [(s.path, s.bins, s.sha256) for s in shards]},
            sort_keys=True,
        )
        rule = dataset.image_rule_or_default
        return cls(
            seq_len=dataset.seq_len,
            num_bins=sum(s.bins for s in shards),
            shards=shards,
            pad_id=dataset.special_id("pad", 0),
            image_pad_id=dataset.special_id("image_pad", -1),
            image_rule=rule.token_rule(),
            max_image_pixels=rule.image_pixel_limit,
            fingerprint=hashlib.sha256(canon.encode()).hexdigest()[:16],
            dataset=dataset,
            video_pad_id=dataset.special_id("video_pad", -1),
        )


def join_url(root: str, rel: str) -> str:
    """Joins a dataset root (path or URL) and a relative path with '/'."""
    return root.rstrip("/") + "/" + rel.lstrip("/")


class DatasetNotFoundError(MmpackError, FileNotFoundError):
    """No packed dataset where one was named: its manifest.json is not there (one line for the user)."""

    default_reason = "dataset_not_found"


def load_manifest(
    root: str,
    *,
    storage_options: dict[str, Any] | None = None,
    shard_format: str | None = None,
    max_attempts: int = 6,
) -> Manifest:
    """Reads `<root>/manifest.json` through fsspec."""
    from fsspec.core import url_to_fs

    url = join_url(root, MANIFEST_NAME)
    fs, fs_path = url_to_fs(url, **resolve_storage_options(url, storage_options))
    policy = RetryPolicy(max_attempts=max_attempts, backoff_s=0.1, max_backoff_s=4.0)
    try:
        # a body cut or changed in transit reads as bad JSON: read again (the manifest has no checksum)
        raw = retry_call(
            lambda: json.loads(fs.cat_file(fs_path)),
            policy,
            transient=lambda e: isinstance(e, ValueError) or is_transient(e),
        )
    except FileNotFoundError as e:
        raise DatasetNotFoundError(
            f"no packed dataset at {root!r}: {url} not found; give the folder (or URL) `mmpack pack -o` wrote"
        ) from e
    except RetriesExhausted as e:
        raise OSError(
            f"cannot read {url} after {e.attempts} attempts: {type(e.last).__name__}: {e.last}"
        ) from e
    return Manifest.from_dict(raw, shard_format=shard_format, source=url)
