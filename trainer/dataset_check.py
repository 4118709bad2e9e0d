"""Refuse a packed dataset made for another model: its image rule and tokenizer against an HF model folder.

The packer records in manifest.json the tokenizer (sha256, special ids, vocabulary size) and the image rule
(patch, merge, temporal patch, min/max pixels, mean/std, rescale, resample) it counted tokens and the loader
makes pixels with. A model folder (`--hf-model DIR`, as written by `save_pretrained`) fixes the same things in
`config.json` (vision patch sizes, image/vision token ids, vocabulary size) and, where present, in its image
processor config (`preprocessor_config.json`, or transformers 5's `processor_config.json`: the image rule's
style too, Qwen2-VL's or Gemma 4's) and `tokenizer.json` (read for the control tokens of the dataset's rules).
Any disagreement means image tokens or pixels the model
would not get from transformers' own processor, so training must not start. Two things are the dataset's own:
its pixel budget (min/max pixels: the vision tower takes any grid, so a dataset may be packed with another
`--max-pixels` than the processor's), and, for a dataset holding no images or videos, its whole image rule.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmpack.packing.image_tokens import ImageTokenRule, image_processor_config
from mmpack.packing.manifest import ManifestCounts, ManifestImageRule
from mmpack.packing.tokenizer import TOKENIZER_FILE, control_tokens_of, load_tokenizer
from mmpack.packing.video_tokens import VideoTokenRule

# ImageTokenRule fields an image processor config settles (max_aspect_ratio is fixed at 200 in transformers).
_PREPROCESSOR_FIELDS = (
    "image_style",
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "min_pixels",
    "max_pixels",
    "image_mean",
    "image_std",
    "rescale_factor",
    "resample",
)
# the dataset's own pixel budget: a difference from the model's processor is noted, not refused
_PIXEL_BUDGET_FIELDS = ("min_pixels", "max_pixels")
# manifest tokenizer special id -> config.json key
_SPECIAL_ID_KEYS = {
    "image_pad": "image_token_id",
    "vision_start": "vision_start_token_id",
    "vision_end": "vision_end_token_id",
    "image_start": "boi_token_id",  # Gemma 4's
    "image_end": "eoi_token_id",
}


class DatasetModelMismatch(ValueError):
    """The packed dataset was made with another image rule or tokenizer than the model folder's."""


def check_dataset_matches_model(
    manifest: Any, model_dir: str | os.PathLike[str], *, dataset: str = "the dataset"
) -> list[str]:
    """Raise `DatasetModelMismatch` naming every value where `manifest` and `model_dir` disagree.

    Args:
        manifest: the dataset's manifest: `mmpack.dataloader.manifest.Manifest`, `mmpack.packing.manifest.Manifest` or the
            parsed manifest.json dict.
        model_dir: an HF model folder (config.json; its image processor config and tokenizer.json are
            checked when present).
        dataset: how to name the dataset in messages (e.g. its --data-path).

    Returns:
        What was compared, one line each (for the training log).

    Raises:
        FileNotFoundError: `model_dir` has no config.json.
        DatasetModelMismatch: one line per disagreement, each naming both values and their files.
    """
    raw = _manifest_dict(manifest)
    folder = Path(model_dir)
    config = _read_config(folder)
    rule = ManifestImageRule.from_dict(raw.get("image_rule") or {}, "manifest.json image_rule").token_rule()
    tokenizer = raw.get("tokenizer") or {}
    problems: list[str] = []
    counts = raw.get("counts")
    vision = counts is None or ManifestCounts.from_dict(counts, "manifest.json counts").holds_vision
    checked = [
        *(_check_vision_config(rule, config, folder, problems) if vision else []),
        *(_check_preprocessor(rule, folder, problems) if vision else ["image rule: none held, none checked"]),
        *_check_token_ids(tokenizer, config, folder, problems),
        *_check_tokenizer_file(tokenizer, folder, problems, rule, raw.get("video_rule")),
    ]
    if problems:
        lines = "\n  ".join(problems)
        raise DatasetModelMismatch(
            f"{dataset} was not packed for the model in {folder}:\n  {lines}\n"
            f"repack it with `mmpack pack --model {folder} ...` (tokenizer and image rule from the model folder)"
        )
    return checked


def _manifest_dict(manifest: Any) -> dict[str, Any]:
    if isinstance(manifest, Mapping):
        return dict(manifest)
    raw = getattr(manifest, "raw", None)
    if isinstance(raw, Mapping):
        return dict(raw)
    if hasattr(manifest, "to_dict"):
        return dict(manifest.to_dict())
    raise TypeError(f"expected a manifest (Manifest or dict), got {type(manifest).__name__}")


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not an HF model folder: no config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return not math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return bool(a != b)


def _check_vision_config(rule: ImageTokenRule, config: dict, folder: Path, problems: list[str]) -> list[str]:
    vision = config.get("vision_config") or {}
    where = folder / "config.json"
    pairs = {
        "patch_size": vision.get("patch_size", vision.get("spatial_patch_size")),
        "merge_size": vision.get("spatial_merge_size", vision.get("pooling_kernel_size")),  # Gemma 4: pooling
        "temporal_patch_size": vision.get("temporal_patch_size"),
    }
    checked = []
    for name, model_value in pairs.items():
        if model_value is None:
            continue
        checked.append(f"image_rule.{name} vs {where} vision_config")
        if _differs(getattr(rule, name), model_value):
            problems.append(
                f"image_rule.{name}: dataset {getattr(rule, name)} (manifest.json), "
                f"model {model_value} ({where} vision_config)"
            )
    return checked


def _check_preprocessor(rule: ImageTokenRule, folder: Path, problems: list[str]) -> list[str]:
    found = image_processor_config(folder)
    if found is None:
        return []
    where, config = found  # the file it is in (and its key in processor_config.json)
    model_rule = ImageTokenRule.from_preprocessor_config(config, source=where)
    notes = []
    for name in _PREPROCESSOR_FIELDS:
        ours, theirs = getattr(rule, name), getattr(model_rule, name)
        if not _differs(ours, theirs):
            continue
        line = f"image_rule.{name}: dataset {_show(ours)} (manifest.json), model {_show(theirs)} ({where})"
        if name in _PIXEL_BUDGET_FIELDS:
            notes.append(f"{line}: the dataset's own pixel budget")
        else:
            problems.append(line)
    return [f"image rule vs {where}", *notes]


def _show(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def _check_token_ids(tokenizer: dict, config: dict, folder: Path, problems: list[str]) -> list[str]:
    where = folder / "config.json"
    special = tokenizer.get("special_ids") or {}
    text = config.get("text_config") or {}
    checked = []
    for role, key in _SPECIAL_ID_KEYS.items():
        model_id = config.get(key, text.get(key))
        if model_id is None or role not in special:
            continue
        checked.append(f"tokenizer special id {role} vs {where} {key}")
        if int(special[role]) != int(model_id):
            problems.append(
                f"tokenizer.special_ids.{role}: dataset {special[role]} (manifest.json), "
                f"model {key}={model_id} ({where})"
            )
    vocab = config.get("vocab_size", text.get("vocab_size"))
    if vocab is not None and tokenizer.get("vocab_size") is not None:
        checked.append(f"tokenizer vocab_size vs {where} vocab_size")
        if int(tokenizer["vocab_size"]) > int(vocab):
            problems.append(
                f"tokenizer.vocab_size: dataset {tokenizer['vocab_size']} (manifest.json) does not fit the "
                f"model's vocab_size {vocab} ({where})"
            )
    return checked


def _check_tokenizer_file(
    tokenizer: dict, folder: Path, problems: list[str], rule: ImageTokenRule, video: Any
) -> list[str]:
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        return []
    video_rule = VideoTokenRule.from_dict(dict(video)) if isinstance(video, Mapping) else None
    try:  # the control tokens of the dataset's rules (Qwen's or Gemma 4's), not always Qwen's
        model_tok = load_tokenizer(path, control_tokens_of(rule, video_rule))
    except ValueError as exc:
        problems.append(f"tokenizer: {exc}")
        return [f"tokenizer vs {path}"]
    if tokenizer.get("is_fallback"):
        problems.append(
            f"tokenizer: dataset packed with the byte-level demo fallback (manifest.json), model has {path}"
        )
        return [f"tokenizer vs {path}"]
    if tokenizer.get("sha256") != model_tok.sha256:
        problems.append(
            f"tokenizer.sha256: dataset {tokenizer.get('sha256')} (manifest.json), model {model_tok.sha256} ({path})"
        )
    special = tokenizer.get("special_ids") or {}
    for role, model_id in sorted(model_tok.special_ids.items()):
        if role in special and int(special[role]) != model_id:
            problems.append(
                f"tokenizer.special_ids.{role}: dataset {special[role]} (manifest.json), model {model_id} ({path})"
            )
    return [f"tokenizer vs {path}"]
