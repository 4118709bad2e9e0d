"""The registry of model families, keyed by the HuggingFace ``model_type`` of ``config.json``.

Each family is one subpackage whose ``FAMILY`` is a :class:`mmpack.trainer.models.protocol.ModelFamily`; a new
family is one new subpackage plus one line in :data:`FAMILIES`. Generic trainer code reaches a family only
through :func:`family` / :func:`family_of`; family modules are imported when first asked for.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmpack.trainer.models.protocol import ModelFamily

FAMILIES: dict[str, str] = {
    "llavaonevision1_5": "mmpack.trainer.models.llava_onevision1_5",
    "llavaonevision1_5_moe": "mmpack.trainer.models.llava_onevision1_5_moe",
    "llava_onevision2": "mmpack.trainer.models.llava_onevision2",
    "llava_onevision2_moe": "mmpack.trainer.models.llava_onevision2_moe",
    "qwen2_5_vl": "mmpack.trainer.models.qwen2_5_vl",
    "qwen3_vl": "mmpack.trainer.models.qwen3_vl",
    "qwen3_vl_moe": "mmpack.trainer.models.qwen3_vl_moe",
}


def family(model_type: str) -> ModelFamily:
    """The family of a ``model_type``; ValueError listing the known ones otherwise."""
    from mmpack.trainer.models.protocol import ModelFamily

    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported (known: {', '.join(sorted(FAMILIES))})")
    found = getattr(importlib.import_module(FAMILIES[model_type]), "FAMILY", None)
    if not isinstance(found, ModelFamily) or found.model_type != model_type:
        raise TypeError(f"{FAMILIES[model_type]}.FAMILY is not the ModelFamily of {model_type!r}")
    return found


def family_of(hf_config: dict[str, Any]) -> ModelFamily:
    """The family of a ``config.json`` dict: its ``model_type``'s, except for LLaVA-OneVision-1.5, whose MoE
    checkpoints keep the dense ``model_type`` with a Qwen3-MoE ``text_config`` (``llavaonevision1_5_moe``)."""
    model_type = str(hf_config.get("model_type"))
    if model_type == "llavaonevision1_5":
        from mmpack.trainer.models.llava_onevision1_5_moe.config import has_experts

        if has_experts(hf_config):
            model_type = "llavaonevision1_5_moe"
    return family(model_type)


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of a model folder, with an error naming the folder when it is missing."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json: give a folder written by save_pretrained")
    return json.loads(path.read_text())
