"""Model families by HuggingFace ``model_type``: each is one subpackage exposing the same names
(``Model``, ``Arch``, ``arch_from_hf_config``, ``tiny_hf_config``, ``build_transformer_configs``,
``load_stage_weights``, ``check_hf_weights``, ``init_stage_random``, ``stage_state_dict``, ``hf_state_dict``,
``stage_rules``), so a new family is one new module plus one line here."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

FAMILIES = {"qwen2_5_vl": "mmpack.trainer.models.qwen2_5_vl"}


def family(model_type: str) -> ModuleType:
    """The module of a model family; ValueError listing the known ones otherwise."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported (known: {', '.join(sorted(FAMILIES))})")
    return importlib.import_module(FAMILIES[model_type])


def family_of(hf_config: dict[str, Any]) -> ModuleType:
    """The family of a ``config.json`` dict."""
    return family(str(hf_config.get("model_type")))


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of a model folder, with an error naming the folder when it is missing."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json: give a folder written by save_pretrained")
    return json.loads(path.read_text())
