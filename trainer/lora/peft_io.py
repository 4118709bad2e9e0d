"""PEFT adapter folders: reading ``adapter_model.safetensors`` by HF module name, whichever spelling of the
names peft saved (``base_model.model.`` + transformers 5's in-memory names, or ``save_pretrained``'s)."""

from __future__ import annotations

from pathlib import Path

import torch

from mmpack.trainer.lora.layer import layer_slots
from mmpack.trainer.lora.spec import ADAPTER_WEIGHTS, LORA, hf_modules, lora_modules, spellings
from mmpack.trainer.models.hf_weights import Rule, merge_tp_shards

PEFT_PREFIX = "base_model.model."  # peft's prefix of every saved tensor name


class PeftTensors:
    """The whole tensors of a PEFT folder's ``adapter_model.safetensors``, read like a model folder's by
    :func:`mmpack.trainer.models.hf_weights.read_shard` (names ``<hf module>.lora_A.weight``)."""

    def __init__(self, folder: str) -> None:
        from safetensors.torch import load_file

        self.path = Path(folder) / ADAPTER_WEIGHTS
        if not self.path.is_file():
            raise ValueError(
                f"--lora-adapter {folder}: no {ADAPTER_WEIGHTS} (peft's save_pretrained writes it)"
            )
        self.tensors: dict[str, torch.Tensor] = {}
        for name, tensor in load_file(str(self.path)).items():
            key = name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name
            self.tensors[
                key.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
            ] = tensor

    def modules(self) -> set[str]:
        """The HF modules the file holds adapters of (as spelled in it)."""
        return {name.rsplit(".lora_", 1)[0] for name in self.tensors}

    def check_modules(self, rules: dict[str, Rule]) -> None:
        """Every module of the file is a linear layer mmpack adapts in the model of ``rules`` (all its parts);
        ValueError naming the others (their adapters would be dropped)."""
        known = {n for rule in lora_modules(rules).values() for m in hf_modules(rule) for n in spellings(m)}
        other = sorted(self.modules() - known)
        if other:
            raise ValueError(
                f"{self.path}: adapters of {', '.join(other[:4])}{' ...' if len(other) > 4 else ''} which mmpack "
                "cannot adapt (LoRA here covers the linear layers of the attention and MLP blocks and the "
                "projector); train the adapter without those modules"
            )

    def _resolve(self, name: str) -> str:
        module, tail = name.rsplit(".lora_", 1)
        for spelled in spellings(module):
            if f"{spelled}.lora_{tail}" in self.tensors:
                return f"{spelled}.lora_{tail}"
        raise ValueError(f"{self.path}: no tensor {name} (the adapter and --lora-target-modules disagree)")

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[self._resolve(name)].shape)

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        t = self.tensors[self._resolve(name)].float()
        t = t[rows] if rows is not None else t
        return t[:, cols] if cols is not None else t


def merge_adapter_shards(
    rules: dict[str, Rule], states: list[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The whole HF adapter tensors (``<hf module>.lora_A.weight``, save_pretrained's module names) of one
    pipeline stage from its TP ranks' adapter tensors by megatron-core parameter name (``rules``: the stage's
    HF rules; ``states`` in TP rank order)."""
    out: dict[str, torch.Tensor] = {}
    for layer, rule in lora_modules(rules).items():
        for slot in layer_slots(rule):
            for which, slot_rule in (("A", slot.a_rule), ("B", slot.b_rule)):
                name = f"{layer}.{LORA}.lora_{which}.{slot.key}"
                if name in states[0]:
                    out |= merge_tp_shards(slot_rule, [s[name] for s in states])
    return out
