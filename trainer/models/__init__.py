"""The registry of model families, by name (a family's ``model_type``, the trainer's ``--model-type``).

Each entry names where the family's :class:`mmpack.trainer.models.protocol.ModelFamily` is: a module's
``FAMILY``, or ``"module:NAME"`` for another name of the module (a MoE variant beside its dense family). A new
family is its own module plus one line in :data:`FAMILIES`. Generic trainer code reaches a family only through
:func:`family` (by name) and :func:`family_of` (the family that claims a ``config.json``, asking every
registered family, :meth:`~mmpack.trainer.models.protocol.ModelFamily.claims`); family modules are imported
when first asked for, and only those registered.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmpack.trainer.models.protocol import ModelArch, ModelFamily

FAMILIES: dict[str, str] = {
    "gemma4": "mmpack.trainer.models.gemma4",
    "gemma4_moe": "mmpack.trainer.models.gemma4:MOE_FAMILY",
    "llavaonevision1_5": "mmpack.trainer.models.llava_onevision1_5",
    "llavaonevision1_5_moe": "mmpack.trainer.models.llava_onevision1_5:MOE_FAMILY",
    "llava_onevision2": "mmpack.trainer.models.llava_onevision2",
    "llava_onevision2_moe": "mmpack.trainer.models.llava_onevision2:MOE_FAMILY",
    "qwen2_5_vl": "mmpack.trainer.models.qwen2_5_vl",
    "qwen3_vl": "mmpack.trainer.models.qwen3_vl",
    "qwen3_vl_moe": "mmpack.trainer.models.qwen3_vl:MOE_FAMILY",
}


def family(name: str) -> ModelFamily[ModelArch]:
    """The family registered as ``name``; ValueError listing the known ones otherwise."""
    from mmpack.trainer.models.protocol import ModelFamily

    if name not in FAMILIES:
        raise ValueError(f"model_type {name!r} is not supported (known: {', '.join(sorted(FAMILIES))})")
    module, _, attribute = FAMILIES[name].partition(":")
    found = getattr(importlib.import_module(module), attribute or "FAMILY", None)
    if not isinstance(found, ModelFamily) or found.model_type != name:
        raise TypeError(f"{FAMILIES[name]} is not the ModelFamily named {name!r}")
    return found


def family_of(hf_config: dict[str, Any]) -> ModelFamily[ModelArch]:
    """The one registered family that claims a ``config.json`` dict; ValueError naming its ``model_type`` and
    the known ones when none does (or the claimants when several do: a registry in conflict)."""
    claimants = [f for f in map(family, FAMILIES) if f.claims(hf_config)]
    if len(claimants) == 1:
        return claimants[0]
    model_type = hf_config.get("model_type")
    if claimants:
        names = ", ".join(f.model_type for f in claimants)
        raise ValueError(f"config.json of model_type {model_type!r} is claimed by several families: {names}")
    known = sorted({t for f in map(family, FAMILIES) for t in f.hf_model_types})
    raise ValueError(
        f"config.json model_type {model_type!r} is not supported (known: {', '.join(known)}); give the "
        "config.json of a supported model"
    )


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of a model folder, with an error naming the folder when it is missing, and the file when
    it is not a JSON object."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json: give a folder written by save_pretrained")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # UnicodeDecodeError too
        raise ValueError(
            f"{path} is not valid JSON ({exc}); give the config.json save_pretrained writes"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{path} holds a JSON {type(config).__name__}, not an object; give the config.json save_pretrained "
            "writes"
        )
    return config
