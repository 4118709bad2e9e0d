"""The one model of `manifest.json`: typed records, one version rule, shard paths kept inside the dataset.

The writer (mmpack.offline_packing.finalize), the loader (mmpack.dataloader.manifest), `mmpack stats` and the tests all
read and write the manifest through `Manifest.from_dict` / `Manifest.to_dict` (`from_json` / `to_json` for
the bytes). Version rule: manifests of version 1..FORMAT_VERSION load; a newer one is refused with a message
to upgrade mmpack. A loaded manifest writes back the same bytes (unknown keys of a known version are kept).

Versions: 1 (first), 2 (adds `counts.truncated` and `image_rule.max_image_pixels`; both optional when
reading, so version 1 manifests load with truncated unknown (None) and the default image limit), 3 (adds
`video_rule` (the `mmpack.packing.video_tokens.VideoTokenRule` the videos were planned with), `counts.videos` and
`counts.video_tokens`, and the optional video fields of the shards (packing/format.py); a version 1 or 2
dataset has no videos, and loads as before).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from mmpack.packing.errors import MmpackError
from mmpack.packing.fileio import json_bytes
from mmpack.packing.format import DEFAULT_MAX_IMAGE_PIXELS, FORMAT_NAME, FORMAT_VERSION, SHARD_FORMATS
from mmpack.packing.image_tokens import ImageTokenRule
from mmpack.packing.video_tokens import VideoTokenRule

_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(MmpackError, ValueError):
    """A manifest that cannot be used; the message names the file (and entry) and what to do."""

    default_reason = "bad_manifest"


def check_shard_path(path: object, where: str) -> str:
    """`path` if it is a relative path that stays inside the dataset root, else ManifestError naming `where`.

    Refused: absolute paths, a scheme or drive (`s3://x`, `file:`, `C:`), `..`/`.`/empty segments,
    backslashes and NUL characters.
    """
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{where}: path must be a non-empty string, got {path!r}")
    problem = None
    if path.startswith("/"):
        problem = "is absolute"
    elif _SCHEME_RE.match(path):
        problem = "has a URL scheme or drive"
    elif "\\" in path or "\0" in path:
        problem = "holds a backslash or NUL character"
    elif any(part in ("", ".", "..") for part in path.split("/")):
        problem = "has an empty, '.' or '..' segment"
    if problem:
        raise ManifestError(
            f"{where}: shard path {path!r} {problem}; shard paths must be relative and stay inside the "
            "dataset folder (the manifest is damaged or was not written by mmpack)"
        )
    return path


def _int(value: object, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ManifestError(f"{where}: must be an integer >= {minimum}, got {value!r}")
    return value


def _opt_int(value: object, where: str, minimum: int = 0) -> int | None:
    return None if value is None else _int(value, where, minimum)


def _mapping(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ManifestError(f"{where}: must be a JSON object, got {type(value).__name__}")
    return dict(value)


def _take(raw: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in raw:
        raise ManifestError(f"{where}: missing {key!r}")
    return raw[key]


@dataclass(frozen=True)
class ShardEntry:
    """One shard file: its path relative to the dataset root and the global bins it holds."""

    path: str
    format: str  # "arrow" | "wds"
    first_bin: int
    bins: int
    samples: int
    tokens: int
    bytes: int
    sha256: str

    @classmethod
    def from_dict(cls, raw: object, where: str) -> ShardEntry:
        entry = _mapping(raw, where)
        path = check_shard_path(_take(entry, "path", where), where)
        where = f"{where} ({path})"
        fmt = _take(entry, "format", where)
        if fmt not in SHARD_FORMATS:
            raise ManifestError(f"{where}: format must be one of {SHARD_FORMATS}, got {fmt!r}")
        sha = _take(entry, "sha256", where)
        if not isinstance(sha, str) or not _SHA256_RE.match(sha):
            raise ManifestError(f"{where}: sha256 must be 64 lowercase hex digits, got {sha!r}")
        ints = {k: _int(_take(entry, k, where), f"{where}: {k}") for k in ("first_bin", "bins", "bytes")}
        counts = {k: _int(_take(entry, k, where), f"{where}: {k}") for k in ("samples", "tokens")}
        return cls(path=path, format=fmt, sha256=sha, **ints, **counts)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class ManifestCounts:
    """samples read = packed + rejected; `truncated` counts packed samples shortened by --overlength truncate
    (None: a version 1 manifest, which did not record it); `videos` and `video_tokens` (None before version 3)
    count the packed videos and their <|video_pad|> tokens."""

    samples_read: int
    samples_packed: int
    samples_rejected: int
    rejected_by_reason: dict[str, int]
    bins: int
    tokens: int
    image_tokens: int
    truncated: int | None = None
    videos: int | None = None
    video_tokens: int | None = None

    @classmethod
    def from_dict(cls, raw: object, where: str) -> ManifestCounts:
        counts = _mapping(raw, where)
        names = ("samples_read", "samples_packed", "samples_rejected", "bins", "tokens", "image_tokens")
        ints = {k: _int(_take(counts, k, where), f"{where}.{k}") for k in names}
        reasons = _mapping(_take(counts, "rejected_by_reason", where), f"{where}.rejected_by_reason")
        by_reason = {str(k): _int(v, f"{where}.rejected_by_reason.{k}") for k, v in reasons.items()}
        opt = {k: _opt_int(counts.get(k), f"{where}.{k}") for k in ("truncated", "videos", "video_tokens")}
        return cls(
            rejected_by_reason=by_reason,
            truncated=opt["truncated"],
            videos=opt["videos"],
            video_tokens=opt["video_tokens"],
            **ints,
        )

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in out.items() if v is not None}

    @property
    def holds_vision(self) -> bool:
        """Whether the packed bins hold images or videos."""
        return self.image_tokens > 0 or bool(self.videos)


_RULE_SIZES = ("patch_size", "merge_size", "min_pixels", "max_pixels")


@dataclass(frozen=True)
class ManifestImageRule:
    """The image-token rule the dataset was counted with, and the largest image (in pixels) it may hold.

    `pixel_options`: further `ImageTokenRule` fields (temporal_patch_size, image_mean, ...) where the
    dataset's rule differs from their defaults, as written."""

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 3136
    max_pixels: int = 12845056
    max_image_pixels: int | None = None  # None: a version 1 manifest (the loader then uses the default)
    pixel_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_rule(cls, rule: ImageTokenRule, max_image_pixels: int | None) -> ManifestImageRule:
        """The entry of `rule`: its sizes, and its other fields where they differ from the defaults."""
        values, defaults = rule.to_dict(), ImageTokenRule().to_dict()
        others = {k: v for k, v in values.items() if k not in _RULE_SIZES and v != defaults[k]}
        sizes = {k: values[k] for k in _RULE_SIZES}
        return cls(**sizes, max_image_pixels=max_image_pixels, pixel_options=others)

    @classmethod
    def from_dict(cls, raw: object, where: str) -> ManifestImageRule:
        rule = _mapping(raw, where)
        known = {f.name for f in fields(ImageTokenRule)} | {"max_image_pixels"}
        unknown = sorted(set(rule) - known)
        if unknown:
            raise ManifestError(f"{where}: unknown keys {unknown}")
        default = cls()
        sizes = {k: _int(rule.get(k, getattr(default, k)), f"{where}.{k}", 1) for k in _RULE_SIZES}
        limit = _opt_int(rule.get("max_image_pixels"), f"{where}.max_image_pixels", 1)
        others = {k: v for k, v in rule.items() if k not in _RULE_SIZES and k != "max_image_pixels"}
        entry = cls(**sizes, max_image_pixels=limit, pixel_options=others)
        try:
            entry.token_rule()
        except (TypeError, ValueError) as e:
            raise ManifestError(f"{where}: {e}") from e
        return entry

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in _RULE_SIZES}
        if self.max_image_pixels is not None:
            out["max_image_pixels"] = self.max_image_pixels
        return out | self.pixel_options

    def token_rule(self) -> ImageTokenRule:
        """The `ImageTokenRule` the loader decodes with."""
        options: dict[str, Any] = {k: getattr(self, k) for k in _RULE_SIZES}
        options |= {k: tuple(v) if isinstance(v, list) else v for k, v in self.pixel_options.items()}
        return ImageTokenRule(**options)

    @property
    def image_pixel_limit(self) -> int:
        """The enforced limit: the manifest's, else the default (40 megapixels)."""
        return self.max_image_pixels if self.max_image_pixels is not None else DEFAULT_MAX_IMAGE_PIXELS


# Top-level keys with a typed field, in the order of the dataclass; any other key is kept in `extra`.
_OPTIONAL_DICTS = ("tokenizer", "chat_template", "algorithm")


@dataclass(frozen=True)
class Manifest:
    """A packed dataset's manifest.json. `format`, `version`, `seq_len` and `shards` are required; the other
    fields are None where a (hand-made or older) manifest leaves them out, and are then not written back."""

    seq_len: int
    shards: tuple[ShardEntry, ...]
    version: int = FORMAT_VERSION
    formats: tuple[str, ...] | None = None
    tokenizer: dict[str, Any] | None = None
    image_rule: ManifestImageRule | None = None
    video_rule: VideoTokenRule | None = None
    chat_template: dict[str, Any] | None = None
    algorithm: dict[str, Any] | None = None
    seed: int | None = None
    overlength: str | None = None
    counts: ManifestCounts | None = None
    created_by: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know, kept as read

    # -- reading --------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: object, *, source: str = "manifest.json") -> Manifest:
        """Validates a parsed manifest.json; ManifestError names `source` and the bad entry."""
        doc = _mapping(raw, source)
        if doc.get("format") != FORMAT_NAME:
            raise ManifestError(
                f"{source}: not an mmpack packed dataset manifest (format={doc.get('format')!r}, "
                f"expected {FORMAT_NAME!r})"
            )
        version = doc.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ManifestError(f"{source}: version must be a positive integer, got {version!r}")
        if version > FORMAT_VERSION:
            raise ManifestError(
                f"{source}: packed format version {version} is newer than this mmpack reads "
                f"(up to {FORMAT_VERSION}); upgrade mmpack to read this dataset"
            )
        seq_len = _int(_take(doc, "seq_len", source), f"{source}: seq_len", 1)
        shard_list = _take(doc, "shards", source)
        if not isinstance(shard_list, list):
            raise ManifestError(f"{source}: shards must be a list, got {type(shard_list).__name__}")
        shards = tuple(ShardEntry.from_dict(s, f"{source}: shards[{i}]") for i, s in enumerate(shard_list))
        _check_bins_contiguous(shards, source)
        known = {"format", "version", "seq_len", "shards", *(f.name for f in fields(cls))}
        return cls(
            seq_len=seq_len,
            shards=shards,
            version=version,
            formats=_formats(doc.get("formats"), source),
            tokenizer=_opt(doc, "tokenizer", _mapping, source),
            image_rule=_opt(doc, "image_rule", ManifestImageRule.from_dict, source),
            video_rule=_opt(doc, "video_rule", _video_rule, source),
            chat_template=_opt(doc, "chat_template", _mapping, source),
            algorithm=_opt(doc, "algorithm", _mapping, source),
            seed=_opt_int(doc.get("seed"), f"{source}: seed"),
            overlength=_opt(doc, "overlength", _str, source),
            counts=_opt(doc, "counts", ManifestCounts.from_dict, source),
            created_by=_opt(doc, "created_by", _str, source),
            extra={k: v for k, v in doc.items() if k not in known},
        )

    @classmethod
    def from_json(cls, data: bytes | str, *, source: str = "manifest.json") -> Manifest:
        """The manifest in the bytes of a manifest.json file."""
        try:
            raw = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"{source}: not valid JSON ({e})") from e
        return cls.from_dict(raw, source=source)

    # -- writing --------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The manifest as plain JSON values (the inverse of `from_dict`)."""
        out: dict[str, Any] = {"format": FORMAT_NAME, "version": self.version, "seq_len": self.seq_len}
        optional = {
            "formats": list(self.formats) if self.formats is not None else None,
            "tokenizer": self.tokenizer,
            "image_rule": self.image_rule.to_dict() if self.image_rule else None,
            "video_rule": self.video_rule.to_dict() if self.video_rule else None,
            "chat_template": self.chat_template,
            "algorithm": self.algorithm,
            "seed": self.seed,
            "overlength": self.overlength,
            "counts": self.counts.to_dict() if self.counts else None,
        }
        out |= {k: v for k, v in optional.items() if v is not None}
        out["shards"] = [s.to_dict() for s in self.shards]
        if self.created_by is not None:
            out["created_by"] = self.created_by
        return out | self.extra

    def to_json(self) -> bytes:
        """The bytes of manifest.json: sorted keys, one-space indent, UTF-8, a final newline."""
        return json_bytes(self.to_dict())

    # -- use ------------------------------------------------------------------------------------------------
    def shards_of(self, shard_format: str) -> tuple[ShardEntry, ...]:
        """The shards of one format, in bin order."""
        return tuple(sorted((s for s in self.shards if s.format == shard_format), key=lambda s: s.first_bin))

    @property
    def shard_formats(self) -> list[str]:
        """Formats that have shards (or that the manifest lists, for an empty dataset), sorted."""
        listed = set(self.formats or ())
        return sorted(listed | {s.format for s in self.shards})

    def default_format(self) -> str:
        """Arrow where the dataset has it, else its first format."""
        formats = self.shard_formats
        return "arrow" if "arrow" in formats or not formats else formats[0]

    def special_id(self, name: str, default: int) -> int:
        """A special token id of the dataset's tokenizer (`default` where the manifest has none)."""
        ids = (self.tokenizer or {}).get("special_ids") or {}
        value = ids.get(name, default)
        return int(value)

    @property
    def image_rule_or_default(self) -> ManifestImageRule:
        return self.image_rule or ManifestImageRule()

    @property
    def holds_videos(self) -> bool:
        """Whether its bins hold videos (a manifest before version 3 holds none)."""
        return bool(self.counts and self.counts.videos)

    @property
    def holds_vision(self) -> bool:
        """Whether its bins hold images or videos, so that its image rule matters (without counts: assumed)."""
        return self.counts is None or self.counts.holds_vision


def _video_rule(value: object, where: str) -> VideoTokenRule:
    raw = _mapping(value, where)
    try:
        return VideoTokenRule.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ManifestError(f"{where}: {e}") from e


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ManifestError(f"{where}: must be a string, got {value!r}")
    return value


def _opt(doc: Mapping[str, Any], key: str, parse: Any, source: str) -> Any:
    value = doc.get(key)
    return None if value is None else parse(value, f"{source}: {key}")


def _formats(value: object, source: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or any(f not in SHARD_FORMATS for f in value):
        raise ManifestError(f"{source}: formats must be a list of {SHARD_FORMATS}, got {value!r}")
    return tuple(value)


def _check_bins_contiguous(shards: tuple[ShardEntry, ...], source: str) -> None:
    """The shards of each format hold bins 0..n-1 in order, without gaps or overlaps."""
    for fmt in SHARD_FORMATS:
        expected = 0
        for s in sorted((s for s in shards if s.format == fmt), key=lambda s: s.first_bin):
            if s.first_bin != expected:
                raise ManifestError(
                    f"{source}: shard {s.path} starts at bin {s.first_bin}, expected {expected} "
                    f"(the {fmt} shards must hold consecutive bins)"
                )
            expected += s.bins
