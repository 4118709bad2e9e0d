"""A LoRA run's adapters out of mmpack: the ``adapter_config.json`` a LoRA run keeps beside its checkpoints (it
names the adapters the dist checkpoint holds), and what ``mmpack convert mcore-to-hf --lora-format`` writes from
them: a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``, loaded by peft onto the transformers
model) or merged HF weights (W + alpha / r * B A on every adapted module)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mmpack.trainer.lora.peft_io import PEFT_PREFIX, to_peft_layout
from mmpack.trainer.lora.spec import ADAPTER_CONFIG, LoraSpec, resolve_spec, spellings


def peft_config(spec: LoraSpec, base_model: str | None) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``spec`` as peft writes it (the fields peft reads back)."""
    return {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": base_model, "inference_mode": True,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
        "target_modules": spec.targets if isinstance(spec.targets, str) else sorted(spec.targets) or None,
        "target_parameters": list(spec.parameters) or None,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None,
    }  # fmt: skip


def write_run_config(save_dir: str, spec: LoraSpec, base_model: str | None) -> None:
    """Keeps the run's LoRA beside its checkpoints (``<save>/adapter_config.json``), for ``mmpack convert``."""
    (Path(save_dir) / ADAPTER_CONFIG).write_text(json.dumps(peft_config(spec, base_model), indent=2))


def checkpoint_spec(ckpt: str) -> LoraSpec | None:
    """The LoRA of the run whose checkpoints are in ``ckpt`` (None: not a LoRA run)."""
    if not (Path(ckpt) / ADAPTER_CONFIG).is_file():
        return None
    spec = resolve_spec(rank=None, alpha=None, dropout=None, targets=None, adapter=ckpt)
    assert spec is not None
    return replace(spec, adapter_dir=None)  # the weights are the checkpoint's


def peft_tensors(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole adapter tensors by ``<hf module>.lora_A.weight`` -> the names peft saves (its prefix and
    transformers 5's in-memory module names)."""
    out = {}
    for name, tensor in to_peft_layout(adapters).items():
        module, tail = name.rsplit(".lora_", 1)
        out[f"{PEFT_PREFIX}{spellings(module)[-1]}.lora_{tail}"] = tensor.contiguous()
    return out


def merge_into(
    weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """HF weights with every adapted module's update merged in: W + scale * B A (computed in fp32); an experts
    parameter's adapters (A [experts, r, in], B [experts, out, r]) into each expert's matrix."""
    merged = dict(weights)
    for name in adapters:
        if ".lora_A." not in name:
            continue
        module = name.rsplit(".lora_", 1)[0]
        a, b = adapters[name].float(), adapters[f"{module}.lora_B.weight"].float()
        if a.dim() == 3:
            _merge_experts(merged, module, scale * torch.bmm(b, a))
            continue
        w = merged[f"{module}.weight"]
        merged[f"{module}.weight"] = (w.float() + scale * (b @ a)).to(w.dtype)
    return merged


def _merge_experts(weights: dict[str, torch.Tensor], parameter: str, delta: torch.Tensor) -> None:
    """Adds ``delta`` [experts, out, in] to a 3-D expert parameter, or to each expert's own matrices where the
    weights hold them apart (``experts.{e}.gate_proj`` and ``up_proj``: the rows of [gate; up])."""
    if parameter in weights:
        w = weights[parameter]
        if tuple(w.shape) != tuple(delta.shape):  # the files' [experts, in, out]
            delta = delta.transpose(1, 2)
        weights[parameter] = (w.float() + delta).to(w.dtype)
        return
    head, _, kind = parameter.rpartition(".")
    for e in range(delta.shape[0]):
        parts = ["gate_proj", "up_proj"] if kind == "gate_up_proj" else ["down_proj"]
        for name, rows in zip(parts, delta[e].chunk(len(parts)), strict=True):
            w = weights[f"{head}.{e}.{name}.weight"]
            weights[f"{head}.{e}.{name}.weight"] = (w.float() + rows).to(w.dtype)


def check_resume_base(load: str, hf_model: str | None) -> None:
    """A LoRA run resuming from ``load`` (whose checkpoints hold only the adapters) needs the base they were
    trained on: ValueError when that run named a model folder and this one gives none."""
    path = Path(load) / ADAPTER_CONFIG
    if not path.is_file():
        return
    base = json.loads(path.read_text()).get("base_model_name_or_path")
    if base and not hf_model:
        raise ValueError(
            f"--load {load} holds LoRA adapters trained on --hf-model {base}; give that --hf-model again (the "
            "checkpoint holds the adapters, not the base model)"
        )
