"""Megatron-style command-line flags of ``mmpack.trainer.pretrain_vlm``, parsed in one place into :class:`RunConfig`.

Each flag is a config field (``mmpack.trainer.flags``: its name, help, choices and the only default live on the
field); the few that are not one field are written here by hand (:data:`HAND_WRITTEN_FLAGS`).
``python -m mmpack.trainer.flag_reference`` writes docs/trainer-flags.md from the same parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

from mmpack.dataloader.mixture import load_mixture_file, parse_inline
from mmpack.trainer.config import DataConfig, ModelConfig, RunConfig
from mmpack.trainer.flags import add_config_flags, config_values, field_default
from mmpack.trainer.stage_flags import HAND_WRITTEN_FLAGS as STAGE_HAND_WRITTEN
from mmpack.trainer.stage_flags import add_stage_flags, refuse_unsupported, resolve_balance

# the flag groups, in --help order: the RunConfig field each one's config fills, and the group's title
SECTIONS: tuple[tuple[str, str], ...] = (
    ("model", "model"),
    ("parallel", "parallelism"),
    ("precision", "mixed precision"),
    ("train", "training"),
    ("optim", "optimizer and schedule"),
    ("data", "data"),
    ("logging", "logging"),
    ("checkpoint", "checkpointing"),
    ("exit", "exiting early (each saves a checkpoint of the last step with --save)"),
    ("stage", "Megatron-LM stage-script flags settled by the dataset or by mmpack's design"),
)

# flags that are not one config field, each added by hand (the reason); every other flag is a field's
HAND_WRITTEN_FLAGS: dict[str, str] = {
    "--model-size": "picks a preset of several size fields",
    "--data-path": "one dataset (data_path), Megatron-LM's weighted blend (data_mixture) or, with "
    "--online-packing, raw inputs (raw_inputs)",
    "--data-mixture": "a mixture file, read into data_mixture",
    **STAGE_HAND_WRITTEN,
}

_SMALL = dict(
    num_layers=12,
    hidden_size=768,
    num_attention_heads=12,
    num_query_groups=4,
    vision_num_layers=12,
    vision_hidden_size=768,
    vision_num_attention_heads=12,
)
# Model presets of --model-size (tiny: ModelConfig's defaults); size flags given explicitly override them.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {f.name: field_default(f) for f in dataclasses.fields(ModelConfig) if f.name in _SMALL},
    "small": _SMALL,
}


def section_configs() -> list[tuple[str, str, type]]:
    """(RunConfig field, group title, config class) of every flag group."""
    hints = typing.get_type_hints(RunConfig)
    return [(name, title, hints[name]) for name, title in SECTIONS]


def _add_model_size(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--model-size", choices=sorted(MODEL_PRESETS), default=None, help="random model: size preset (tiny when not given); explicit size flags override it")  # fmt: skip


def _add_data_source(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--data-path", nargs="+", default=None, help="packed dataset (folder or s3:// / http(s):// URL), or a weighted mixture: W1 PATH1 W2 PATH2 ...; with --online-packing, raw records: files, folders, globs or URLs")  # fmt: skip
    g.add_argument("--data-mixture", default=None, help="a mixture file (YAML or JSON: sources with path, weight or repeat, name, storage_options)")  # fmt: skip


# the hand-written flags of a group, added before (data) or after (the others) its fields' flags
_BEFORE = {"data": _add_data_source}
_AFTER = {"model": _add_model_size, "stage": add_stage_flags}


def build_parser() -> argparse.ArgumentParser:
    """All flags, grouped like Megatron-LM's."""
    p = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node N -m mmpack.trainer.pretrain_vlm",
        description="Train a vision-language model (a model family of mmpack.trainer.models on megatron-core) on a packed "
        "dataset with TP x PP x DP, from a HuggingFace checkpoint (--hf-model) or a small random model (size "
        "flags). Without CUDA it runs on CPU processes with gloo.",
    )
    for name, title, cls in section_configs():
        g = p.add_argument_group(title)
        if name in _BEFORE:
            _BEFORE[name](g)
        add_config_flags(g, cls)
        if name in _AFTER:
            _AFTER[name](g)
    return p


# mixture-of-experts flags a model's config.json fixes, checked like its sizes
MOE_FLAGS = ("num_experts", "moe_router_topk", "moe_aux_loss_coeff")


def _size_flags(given: dict[str, Any], model_size: str | None) -> tuple[tuple[str, float, str], ...]:
    """(field, value, flag) of every model size the command line sets: by a size flag (``given``), or by the
    ``--model-size`` preset where no flag overrides it."""
    sizes = {*_SMALL, "ffn_hidden_size", *MOE_FLAGS}
    named = [(k, given[k], f"--{k.replace('_', '-')}") for k in sorted(sizes) if k in given]
    preset = MODEL_PRESETS[model_size] if model_size else {}
    return tuple(named + [(k, v, f"--model-size {model_size}") for k, v in preset.items() if k not in given])


def _data_flags(args: argparse.Namespace) -> dict[str, Any]:
    """`--data-path` (one dataset, Megatron's `W1 A W2 B` blend, or with `--online-packing` raw inputs) and
    `--data-mixture` as DataConfig fields."""
    words = args.data_path or []
    if args.data_mixture and words:
        raise ValueError("give --data-path or --data-mixture, not both")
    if getattr(args, "online_packing", False) and not args.data_mixture:
        return {"data_path": None, "data_mixture": None, "raw_inputs": tuple(words)}
    if args.data_mixture:
        return {"data_path": None, "data_mixture": load_mixture_file(args.data_mixture)}
    if len(words) > 1:
        return {"data_path": None, "data_mixture": parse_inline(words)}
    return {"data_path": words[0] if words else None, "data_mixture": None}


def parse_args(argv: Sequence[str] | None = None) -> RunConfig:
    """Parse flags into a validated :class:`RunConfig` (raises ``SystemExit``/``ValueError`` on bad input)."""
    args = build_parser().parse_args(argv)
    refuse_unsupported(args)
    values = {name: config_values(cls, args) for name, _, cls in section_configs()}
    model = values.pop("model")
    preset = MODEL_PRESETS[args.model_size] if args.model_size else {}
    data = {**values.pop("data"), "balance": resolve_balance(args)}
    return RunConfig(
        model=ModelConfig(**{**preset, **model}, size_flags=_size_flags(model, args.model_size)),
        data=DataConfig(**data, **_data_flags(args)),
        **{name: cls(**values[name]) for name, _, cls in section_configs() if name in values},
    )
