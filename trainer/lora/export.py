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

from mmpack.trainer.lora.peft_io import PEFT_PREFIX
from mmpack.trainer.lora.spec import ADAPTER_CONFIG, LoraSpec, resolve_spec, spellings


def peft_config(spec: LoraSpec, base_model: str | None) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``spec`` as peft writes it (the fields peft reads back)."""
    return {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": base_model, "inference_mode": True,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
        "target_modules": spec.targets if isinstance(spec.targets, str) else sorted(spec.targets),
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
    for name, tensor in adapters.items():
        module, tail = name.rsplit(".lora_", 1)
        out[f"{PEFT_PREFIX}{spellings(module)[-1]}.lora_{tail}"] = tensor.contiguous()
    return out


def merge_into(
    weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """HF weights with every adapted module's update merged in: W + scale * B A (computed in fp32)."""
    merged = dict(weights)
    for name in adapters:
        if ".lora_A." not in name:
            continue
        module = name.rsplit(".lora_", 1)[0]
        a, b = adapters[name].float(), adapters[f"{module}.lora_B.weight"].float()
        w = merged[f"{module}.weight"]
        merged[f"{module}.weight"] = (w.float() + scale * (b @ a)).to(w.dtype)
    return merged


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
