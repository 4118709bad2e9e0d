"""The mixture spec: several packed datasets blended by weight (or by repeat, in epochs of each source).

Written by hand in Megatron's inline form (`0.3 s3://bucket/a 0.7 /data/b`, `--data-path`) or as a YAML/JSON
file (`--data-mixture mix.yaml`)::

    sources:
      - {path: s3://bucket/ocr, weight: 0.3, name: ocr, storage_options: {anon: true}}
      - {path: /data/captions, weight: 0.7}

A source may be raw records (`{path: data/*.jsonl, kind: raw, weight: 0.2, image_root: DIR, packing_buffer_size:
N}`), packed online in one buffer as the loader starts (`mmpack.dataloader.raw_source.mixture_manifest`) with the
tokenizer and rules of the trainer's model folder.

Either every source has a `weight` (shares of the blended stream, normalised to sum 1) or every source has a
`repeat` (epochs of that source per epoch of the mixture: shares proportional to repeat x bins). A mixture file
is input and bounded like any: a regular file (not a FIFO or a device) of at most `MAX_MIXTURE_FILE_BYTES`, YAML
aliases expanding to at most `MAX_MIXTURE_NODES` nodes, only the keys above, weights and repeats finite numbers
within `WEIGHT_RANGE` / `REPEAT_RANGE` (a bool is not one). The same
dataset named twice (two paths to one folder, one URL written twice) is refused: it would replay its bins as
if they were two sources. The sources must agree in what one model needs (`check_sources`: length, token ids,
tokenizer, vision geometry); each keeps its own pixel budget, by which the loader decodes its bins.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mmpack.dataloader.bounded_files import load_yaml_bounded, read_regular_file, short_repr

MAX_MIXTURE_FILE_BYTES = 4 << 20
# YAML nodes once aliases are expanded (a scalar counts 1 + its length)
MAX_MIXTURE_NODES = 2 * MAX_MIXTURE_FILE_BYTES
WEIGHT_RANGE = (1e-9, 1e12)  # shares are ratios of weights: wider ranges only lose precision or overflow
REPEAT_RANGE = (1e-6, 1e6)  # epochs of a source per epoch of the mixture
SOURCE_KEYS = (
    "path",
    "weight",
    "repeat",
    "name",
    "storage_options",
    "kind",
    "image_root",
    "packing_buffer_size",
)
SOURCE_KINDS = ("packed", "raw")  # a packed dataset, or raw records packed online (in one buffer)
TOP_LEVEL_KEYS = ("sources",)


@dataclass(kw_only=True, frozen=True)
class MixtureSource:
    """One source of a mixture: where it is, its weight or repeat, a name for logs and its storage; a packed
    dataset, or raw records (`kind: raw`)."""

    path: str
    weight: float | None = None
    repeat: float | None = None
    name: str = ""  # empty: the folder's name (its path where two sources share a folder name)
    storage_options: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    # kind "raw": `path` names raw records (files, folders, globs or URLs, as `mmpack pack -i` takes them), packed
    # online in one buffer of `packing_buffer_size` records with media under `image_root` (the trainer's flags by
    # default); `raw` is the opened source (`mmpack.dataloader.raw_source.RawBins`), which the loader reads
    kind: str = "packed"
    image_root: str | None = None
    packing_buffer_size: int | None = None
    raw: Any = field(default=None, hash=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"a mixture source needs a path (a string), got {short_repr(self.path)}")
        if not isinstance(self.name, str):
            raise ValueError(
                f"mixture source {self.path!r}: name must be a string (quote a number), got {short_repr(self.name)}"
            )
        if (self.weight is None) == (self.repeat is None):
            raise ValueError(f"mixture source {self.path!r}: give exactly one of weight and repeat")
        for key, (low, high) in (("weight", WEIGHT_RANGE), ("repeat", REPEAT_RANGE)):
            value = getattr(self, key)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if value is not None and not (number and math.isfinite(value) and low <= value <= high):
                hint = " (YAML reads 1e-3 as text: write 1.0e-3 or 0.001)" if isinstance(value, str) else ""
                raise ValueError(
                    f"mixture source {self.path!r}: {key} must be a positive number from {low:g} to {high:g}, got "
                    f"{short_repr(value)}{hint}"
                )
        if self.raw is not None and self.kind == "packed":  # an opened raw source is one
            object.__setattr__(self, "kind", "raw")
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"mixture source {self.path!r}: kind must be one of {SOURCE_KINDS}, got {short_repr(self.kind)}")  # fmt: skip
        if self.kind != "raw" and (self.image_root is not None or self.packing_buffer_size is not None):
            raise ValueError(f"mixture source {self.path!r}: image_root and packing_buffer_size are keys of a 'kind: raw' source")  # fmt: skip
        size = self.packing_buffer_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"mixture source {self.path!r}: packing_buffer_size must be a number of records >= 1, got {short_repr(size)}")  # fmt: skip
        if self.storage_options is not None and not (
            isinstance(self.storage_options, dict) and all(isinstance(k, str) for k in self.storage_options)
        ):
            raise ValueError(
                f"mixture source {self.path!r}: storage_options must be a mapping of option names, got "
                f"{short_repr(self.storage_options)}"
            )

    @property
    def identity(self) -> str:
        """What two sources share when they are the same dataset: the resolved folder or the URL (a raw source:
        its records and options, by fingerprint)."""
        if self.raw is not None:
            return f"raw records {self.raw.fingerprint}"
        if self.kind == "raw":
            return f"raw records {self.path}"
        if "://" in self.path:
            return self.path.rstrip("/")
        return os.path.realpath(self.path)


@dataclass(kw_only=True, frozen=True)
class Mixture:
    """The sources of a blended stream, in the order that `source_ids` numbers them."""

    sources: tuple[MixtureSource, ...]

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("a mixture needs at least one source")
        if len({s.weight is None for s in self.sources}) > 1:
            raise ValueError("a mixture gives every source a weight or every source a repeat, not both")
        seen: dict[str, str] = {}
        for s in self.sources:
            if s.identity in seen:
                raise ValueError(
                    f"mixture names one dataset twice: {seen[s.identity]!r} and {s.path!r} are both "
                    f"{s.identity!r}; give it once (with the sum of the weights)"
                )
            seen[s.identity] = s.path
        names = [s.name for s in self.sources if s.name]
        if len(set(names)) != len(names):
            raise ValueError(
                f"mixture source names must differ, got {short_repr(names)}; give each its own name"
            )

    @property
    def names(self) -> tuple[str, ...]:
        """Each source's name for logs and metrics: its own, else its folder's name, else its path."""
        base = [s.name or s.path.rstrip("/").rsplit("/", 1)[-1] or s.path for s in self.sources]
        names = [b if s.name or base.count(b) == 1 else s.path for s, b in zip(self.sources, base)]
        if len(set(names)) != len(names):
            raise ValueError(
                f"mixture source names must differ, got {short_repr(names)}; give each its own name"
            )
        return tuple(names)

    @property
    def raw_sources(self) -> tuple[str, ...]:
        """The names of its `kind: raw` sources."""
        return tuple(n for s, n in zip(self.sources, self.names) if s.kind == "raw")

    @property
    def by_repeat(self) -> bool:
        return self.sources[0].repeat is not None

    def shares(self, num_bins: Sequence[int]) -> tuple[float, ...]:
        """Each source's share of the blended stream (sums to 1), given the sources' bin counts."""
        raw = [
            float(s.repeat) * n if s.repeat is not None else float(s.weight or 0)
            for s, n in zip(self.sources, num_bins)
        ]
        top = max(raw)
        if not (math.isfinite(top) and top > 0):
            raise ValueError(
                f"mixture shares need finite weights and sources with bins, got {short_repr(raw)}"
            )
        scaled = [r / top for r in raw]  # the largest is 1: the sum cannot overflow
        total = sum(scaled)
        return tuple(r / total for r in scaled)

    def epoch_bins(self, num_bins: Sequence[int]) -> int:
        """Bins in one epoch of the mixture: every source's bins (by weight), or repeat x bins (by repeat)."""
        if self.by_repeat:
            return max(1, round(sum(float(s.repeat or 0) * n for s, n in zip(self.sources, num_bins))))
        return int(sum(num_bins))

    def to_dict(self) -> dict[str, Any]:
        return {"sources": [_source_dict(s) for s in self.sources]}


def _source_dict(s: MixtureSource) -> dict[str, Any]:
    out: dict[str, Any] = {"path": s.path, "name": s.name} if s.name else {"path": s.path}
    out |= {"weight": s.weight} if s.weight is not None else {"repeat": s.repeat}
    if s.kind == "raw":
        out["kind"] = "raw"
        out |= {k: v for k in ("image_root", "packing_buffer_size") if (v := getattr(s, k)) is not None}
    return out


def parse_inline(spec: str | Sequence[str]) -> Mixture:
    """Megatron's inline blend: `weight path weight path ...` (a string or its words)."""
    words = spec.split() if isinstance(spec, str) else list(spec)
    if not words or len(words) % 2:
        raise ValueError(
            f"mixture {' '.join(words)!r}: give pairs of weight and path (e.g. '0.3 /data/a 0.7 s3://b/c')"
        )
    sources = []
    for weight, path in zip(words[::2], words[1::2]):
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(
                f"mixture {' '.join(words)!r}: {weight!r} is not a weight (before {path!r})"
            ) from None
        sources.append(MixtureSource(path=path, weight=value))
    return Mixture(sources=tuple(sources))


def load_mixture_file(path: str) -> Mixture:
    """A mixture from a YAML or JSON file: `{sources: [{path, weight | repeat, name?, storage_options?}]}` (or the
    list alone). Every refusal is a ValueError naming the file and what to change."""
    text = read_regular_file(path, "mixture file", MAX_MIXTURE_FILE_BYTES, advice="give a YAML or JSON file")
    try:
        raw = json.loads(text) if path.endswith(".json") else load_yaml_bounded(text, MAX_MIXTURE_NODES)
    except RecursionError:
        raise ValueError(f"mixture file {path} nests too deep to parse; a mixture is a flat list") from None
    except ValueError as e:
        raise ValueError(f"mixture file {path} does not parse: {e}") from None
    if isinstance(raw, dict):
        unknown = [k for k in raw if k not in TOP_LEVEL_KEYS]
        if unknown:
            raise ValueError(
                f"mixture file {path}: unknown top-level key(s) {short_repr(unknown)}; it holds only "
                f"{list(TOP_LEVEL_KEYS)}"
            )
    entries = raw.get("sources") if isinstance(raw, dict) else raw
    if not isinstance(entries, list):
        raise ValueError(f"mixture file {path}: want a list under 'sources', got {type(entries).__name__}")
    sources = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(
                f"mixture file {path}: source {i} must be a mapping of {list(SOURCE_KEYS)}, got {short_repr(entry)}"
            )
        unknown = [k for k in entry if k not in SOURCE_KEYS]
        if unknown:
            raise ValueError(
                f"mixture file {path}: source {i} must be a mapping of {list(SOURCE_KEYS)}; unknown key(s) "
                f"{short_repr(unknown)}"
            )
        try:
            sources.append(MixtureSource(**entry))
        except (TypeError, ValueError) as e:
            raise ValueError(f"mixture file {path}: source {i}: {e}") from None
    try:
        return Mixture(sources=tuple(sources))
    except ValueError as e:
        raise ValueError(f"mixture file {path}: {e}") from None


MixtureLike = str | Sequence[tuple[float, Any]] | Mixture


def as_mixture(data: MixtureLike) -> Mixture | None:
    """The mixture `build_loader` was given; None for one dataset path (read exactly as it always was)."""
    if isinstance(data, Mixture):
        return data
    if isinstance(data, str):
        return None
    pairs = list(data)
    sources = []
    for pair in pairs:
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise ValueError(f"a mixture list holds (weight, path) pairs, got {pair!r}")
        weight, path = pair
        if callable(getattr(path, "pack_buffer", None)):  # a raw source (`raw_source.RawBins`)
            sources.append(MixtureSource(path=path.name, weight=weight, kind="raw", raw=path))
        elif isinstance(path, str):
            sources.append(MixtureSource(path=path, weight=weight))
        else:
            raise ValueError(f"a mixture list holds (weight, path or raw source) pairs, got {pair!r}")
    return Mixture(sources=tuple(sources))


def check_sources(names: Sequence[str], manifests: Sequence[Any]) -> None:
    """One clear error for sources a blended batch cannot hold together (`manifests`: the loader's `Manifest`
    of each source): every source has bins and the first one's seq_len, token ids and tokenizer; the sources
    holding images or videos share the image rule's style and the vision tower's geometry (patch, merge, temporal
    patch) and pixel normalisation, those holding videos the video rule's style. Each source keeps its own pixel budget (min and
    max pixels, largest image, resampling, video sampling), by which the loader decodes its bins: the tower
    takes any grid. A source without images or videos mixes with any image rule."""
    for name, m in zip(names, manifests):
        if m.num_bins == 0:
            raise ValueError(f"mixture source {name!r} has no bins; repack it or leave it out of the mixture")
    everyone = range(len(manifests))
    vision = [i for i in everyone if manifests[i].dataset.holds_vision]
    videos = [i for i in everyone if manifests[i].dataset.holds_videos]
    for group, rules in (
        (everyone, _SHARED_BY_ALL),
        (vision, _SHARED_BY_VISION),
        (videos, _SHARED_BY_VIDEOS),
    ):
        for what, value, advice in rules:
            _check_agree([names[i] for i in group], [value(manifests[i]) for i in group], what, advice)
    first, m0 = names[0], manifests[0]
    for name, m in zip(names[1:], manifests[1:]):
        a, b = _tokenizer_sha(m0), _tokenizer_sha(m)
        if a and b and a != b:
            raise ValueError(
                f"mixture sources {first!r} and {name!r} were packed with different tokenizers (sha256 "
                f"{a[:12]} vs {b[:12]}, manifest.json); their token ids mean other words: repack them with one "
                "`mmpack pack --tokenizer`"
            )


def vision_source(manifests: Sequence[Any], *, videos: bool = False) -> int:
    """Index of the first source holding images or videos (`videos`: videos), whose image rule's geometry
    (the same in every such source, `check_sources`) is the mixture's; 0 where no source holds any."""
    holds = [m.dataset.holds_videos if videos else m.dataset.holds_vision for m in manifests]
    return holds.index(True) if True in holds else 0


def _check_agree(names: Sequence[str], values: Sequence[Any], what: str, advice: str) -> None:
    for name, value in zip(names[1:], values[1:]):
        if value != values[0]:
            raise ValueError(
                f"mixture sources {names[0]!r} and {name!r} differ in {what} ({values[0]} vs {value}); {advice}"
            )


_GEOMETRY = ("patch_size", "merge_size", "temporal_patch_size")
_NORMALISATION = ("image_mean", "image_std", "rescale_factor")
# (what, its value in a source's loader Manifest, what to do where two sources differ) of each group
_SHARED_BY_ALL = (
    (
        "seq_len",
        lambda m: m.seq_len,
        "a micro-batch holds bins of one length: repack one with the other's -L",
    ),
    (
        "token ids (pad, image_pad, video_pad)",
        lambda m: (m.pad_id, m.image_pad_id, m.video_pad_id),
        "their token ids mean other tokens: repack them with one tokenizer (`mmpack pack -t` or --model)",
    ),
)
_SHARED_BY_VISION = (
    (
        "image rule style",
        lambda m: m.image_rule.image_style,
        "one model's processor lays out image tokens and pixels one way (Qwen2-VL's, Gemma 4's): repack one "
        "with the model folder of the other (`mmpack pack --model DIR`)",
    ),
    (
        "vision geometry (" + ", ".join(_GEOMETRY) + ")",
        lambda m: tuple(getattr(m.image_rule, f) for f in _GEOMETRY),
        "one vision tower cuts every image into one patch geometry: repack one with the model folder of the "
        "other (`mmpack pack --model DIR`; pixel budgets such as --max-pixels may differ)",
    ),
    (
        "pixel normalisation (" + ", ".join(_NORMALISATION) + ")",
        lambda m: tuple(getattr(m.image_rule, f) for f in _NORMALISATION),
        "one vision tower takes its pixels normalised one way: repack one with the model folder of the other "
        "(`mmpack pack --model DIR`)",
    ),
)
_SHARED_BY_VIDEOS = (
    (
        "video rule style",
        lambda m: m.dataset.video_rule.style if m.dataset.video_rule else "",
        "one model lays out video tokens one way: repack one with the model folder (`mmpack pack --model DIR`)",
    ),
)


def _tokenizer_sha(manifest: Any) -> str | None:
    """The sha256 of the tokenizer file a source was packed with (None: the manifest does not record it)."""
    sha = (manifest.raw.get("tokenizer") or {}).get("sha256")
    return str(sha) if sha else None
