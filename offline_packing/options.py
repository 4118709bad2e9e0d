"""The flat option names of a packing job and the nested `PackJobConfig` they fill, mapped by field name.

An option is named like the field it sets: a field of `PackJobConfig` itself (`seq_len`), of one of its
sections (`seed` of `binpack`, `workers` of `control`), or of an object of the lengths section with that
object's prefix: the image rule's fields as they are (`patch_size`), the video rule's after `video_`
(`video_fps`; its patch sizes are the image rule's), the chat template's after `chat_`
(`chat_default_system`). The flags of `mmpack pack` are these names (`--video-fps` sets `video_fps`), and an
option not given takes its field's default, so every default is written once, in `mmpack.offline_packing.config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from mmpack.offline_packing.config import (
    SHARED_PATCH_FIELDS,
    BinpackConfig,
    ControlConfig,
    LengthsConfig,
    PackJobConfig,
    ScanConfig,
    WriteConfig,
)
from mmpack.packing.chat_template import ChatTemplate
from mmpack.packing.image_tokens import ImageTokenRule
from mmpack.packing.video_tokens import VideoTokenRule

SECTIONS: dict[str, type] = {
    "scan": ScanConfig,
    "lengths": LengthsConfig,
    "binpack": BinpackConfig,
    "write": WriteConfig,
    "control": ControlConfig,
}
# Objects of the lengths section whose fields are options too: (class, option name prefix).
RULES: dict[str, tuple[type, str]] = {
    "image_rule": (ImageTokenRule, ""),
    "video_rule": (VideoTokenRule, "video_"),
    "chat_template": (ChatTemplate, "chat_"),
}
_JOB_FIELDS = tuple(f.name for f in dataclasses.fields(PackJobConfig) if f.name not in SECTIONS)


def _own_fields(cls: type) -> Iterator[dataclasses.Field]:
    """The fields of `cls` that are options (a section's rules are options field by field)."""
    for f in dataclasses.fields(cls):
        if f.name in RULES or (cls is VideoTokenRule and f.name in SHARED_PATCH_FIELDS):
            continue
        yield f


def option_fields() -> dict[str, tuple[str, str | None, dataclasses.Field]]:
    """Option name -> (section or "" for the job itself, rule or None, the field it sets)."""
    out: dict[str, tuple[str, str | None, dataclasses.Field]] = {}
    job = {f.name: f for f in dataclasses.fields(PackJobConfig)}
    for name in _JOB_FIELDS:
        out[name] = ("", None, job[name])
    for section, cls in SECTIONS.items():
        out |= {f.name: (section, None, f) for f in _own_fields(cls)}
    for rule, (cls, prefix) in RULES.items():
        out |= {prefix + f.name: ("lengths", rule, f) for f in _own_fields(cls)}
    return out


def option_default(name: str) -> Any:
    """The default of option `name` (from its field)."""
    f = option_fields()[name][2]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise KeyError(f"option {name!r} has no default")


def _build(cls: type, given: dict[str, Any], prefix: str, extra: dict[str, Any]) -> Any:
    return cls(
        **{f.name: given.pop(prefix + f.name) for f in _own_fields(cls) if prefix + f.name in given}, **extra
    )


def job_config(**options: Any) -> PackJobConfig:
    """The job config of flat `options` (see the module docstring); an option may also be a whole rule
    (`image_rule=ImageTokenRule(...)`) or section (`binpack=BinpackConfig(...)`) instead of its fields.

    Raises:
        TypeError: an option name that sets no field, or a rule or section given both whole and by field.
        ValueError: a value the configs refuse (their checks name the flag).
    """
    given = dict(options)
    known = option_fields()
    unknown = sorted(set(given) - known.keys() - SECTIONS.keys() - RULES.keys())
    if unknown:
        raise TypeError(f"unknown packing option(s) {unknown}; known: {sorted(known)}")
    for whole in (*SECTIONS, *RULES):
        parts = [n for n, (section, rule, _) in known.items() if n in given and whole in (section, rule)]
        if whole in given and parts:
            raise TypeError(f"{whole} is given whole and by field ({parts}); give one")
    rules = {k: given.pop(k) for k in RULES if k in given}
    if "image_rule" not in rules:
        rules["image_rule"] = _build(ImageTokenRule, given, "", {})
    if "video_rule" not in rules:
        patch = {n: getattr(rules["image_rule"], n) for n in SHARED_PATCH_FIELDS}
        rules["video_rule"] = _build(VideoTokenRule, given, "video_", patch)
    if "chat_template" not in rules:
        rules["chat_template"] = _build(ChatTemplate, given, "chat_", {})
    sections = {k: given.pop(k) for k in SECTIONS if k in given}
    for name, cls in SECTIONS.items():
        if name not in sections:
            sections[name] = _build(cls, given, "", rules if name == "lengths" else {})
    return PackJobConfig(**{k: given.pop(k) for k in _JOB_FIELDS if k in given}, **sections)


def job_options(cfg: PackJobConfig) -> dict[str, Any]:
    """The flat options of `cfg`: `job_config(**job_options(cfg)) == cfg`."""
    out: dict[str, Any] = {}
    for name, (section, rule, f) in option_fields().items():
        owner: Any = cfg if not section else getattr(cfg, section)
        if rule is not None:
            owner = getattr(owner, rule)
        out[name] = getattr(owner, f.name)
    return out


def with_options(cfg: PackJobConfig, **changes: Any) -> PackJobConfig:
    """`cfg` with the flat options `changes` set (a rule or section may be given whole); the video rule's
    patch sizes follow the image rule."""
    base = job_options(cfg)
    for whole in set(changes) & (SECTIONS.keys() | RULES.keys()):
        for name, (section, rule, _) in option_fields().items():
            if whole in (section, rule):
                base.pop(name, None)
    return job_config(**{**base, **changes})
