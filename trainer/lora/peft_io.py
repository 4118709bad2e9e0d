"""PEFT adapter folders: reading ``adapter_model.safetensors`` by HF module name, whichever spelling of the
names peft saved (``base_model.model.`` + transformers 5's in-memory names, or ``save_pretrained``'s).

peft saves its adapters of an experts module's 3-D parameters (``target_parameters``) under the module's name,
nested in the order the module defines them: with both ``gate_up_proj`` and ``down_proj`` adapted,
``experts.base_layer.lora_A.weight`` is gate_up_proj's and ``experts.lora_A.weight`` down_proj's. Here they are
``<module>.<parameter>.lora_A.weight`` in the per-expert layout (A [experts, r, in], B [experts, out, r];
peft's A is [r * experts, in], its B [out, r * experts] with expert e in columns e, e + experts, ...)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from mmpack.trainer.lora.layer import expert_slots, layer_slots
from mmpack.trainer.lora.spec import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    EXPERT_PARAMETERS,
    LORA,
    expert_layers,
    hf_modules,
    lora_modules,
    spellings,
)
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
        config_path = Path(folder) / ADAPTER_CONFIG
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        parameters = tuple(config.get("target_parameters") or ())
        for name, tensor in load_file(str(self.path)).items():
            key = name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name
            key = key.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
            module, tail = key.rsplit(".lora_", 1)
            if parameters and _EXPERTS_MODULE.search(module):
                key, tensor = _per_expert(module, tail, tensor, parameters, int(config["r"]), self.path)
            self.tensors[key] = tensor

    def modules(self) -> set[str]:
        """The HF modules the file holds adapters of (as spelled in it)."""
        return {name.rsplit(".lora_", 1)[0] for name in self.tensors}

    def check_modules(self, rules: dict[str, Rule]) -> None:
        """Every module of the file is a linear layer mmpack adapts in the model of ``rules`` (all its parts);
        ValueError naming the others (their adapters would be dropped)."""
        known = {n for rule in lora_modules(rules).values() for m in hf_modules(rule) for n in spellings(m)}
        known |= {n for _, param in expert_layers(rules).values() for n in spellings(param)}
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

    def read(
        self, name: str, rows: slice | None = None, cols: slice | None = None, expert: int | None = None
    ) -> torch.Tensor:
        t = self.tensors[self._resolve(name)].float()
        t = t[expert] if expert is not None else t
        t = t[rows] if rows is not None else t
        return t[:, cols] if cols is not None else t


_EXPERTS_MODULE = re.compile(r"\.experts(\.base_layer)*$")


def targeted_parameters(module: str, parameters: tuple[str, ...]) -> list[str]:
    """The parameters of the experts module ``module`` that peft's ``target_parameters`` name, in the order
    the module defines them (peft's nesting order)."""
    return [
        p for p in EXPERT_PARAMETERS.values()
        if any(n == t or n.endswith("." + t) for t in parameters for n in spellings(f"{module}.{p}"))
    ]  # fmt: skip


def _per_expert(
    module: str, tail: str, tensor: torch.Tensor, parameters: tuple[str, ...], rank: int, path: Path
) -> tuple[str, torch.Tensor]:  # fmt: skip
    """One of peft's expert adapter tensors (``<experts>[.base_layer...].lora_<tail>``) -> its name and tensor
    in the per-expert layout (see the module docstring)."""
    depth = module.count(".base_layer")
    experts = module.removesuffix(".base_layer" * depth)
    targeted = targeted_parameters(experts, parameters)
    if depth >= len(targeted):
        raise ValueError(
            f"{path}: {module} is not an adapter of {', '.join(targeted) or 'a targeted parameter'}"
        )
    param = targeted[len(targeted) - 1 - depth]
    if tail.startswith("A"):  # [r * experts, in] -> [experts, r, in]
        return f"{experts}.{param}.lora_{tail}", tensor.reshape(-1, rank, tensor.shape[-1])
    # [out, r * experts] -> [experts, out, r]
    return f"{experts}.{param}.lora_{tail}", tensor.reshape(tensor.shape[0], rank, -1).permute(2, 0, 1)


def to_peft_layout(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole adapter tensors by HF name with the experts' in the per-expert layout -> the experts' in peft's
    (the inverse of what :class:`PeftTensors` reads; names without peft's prefix)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[str, str], torch.Tensor]] = {}
    for name, tensor in adapters.items():
        module, tail = name.rsplit(".lora_", 1)
        head, _, last = module.rpartition(".")
        if tensor.dim() == 3 and head.endswith(".experts") and last in EXPERT_PARAMETERS.values():
            experts.setdefault(head, {})[(last, tail)] = tensor
        else:
            out[name] = tensor
    for head, tensors in experts.items():
        targeted = [p for p in EXPERT_PARAMETERS.values() if (p, "A.weight") in tensors]
        for i, param in enumerate(targeted):
            module = head + ".base_layer" * (len(targeted) - 1 - i)
            a, b = tensors[(param, "A.weight")], tensors[(param, "B.weight")]
            out[f"{module}.lora_A.weight"] = a.reshape(-1, a.shape[-1])
            out[f"{module}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1)
    return out


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
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    counts: dict[str, int] = {}
    for layer, slot in expert_slots(rules).items():  # every expert's adapters (EP 1): stacked per parameter
        for which, slot_rule in (("A", slot.a_rule), ("B", slot.b_rule)):
            name = f"{layer}.{LORA}.lora_{which}.{slot.key}"
            if name in states[0]:
                for hf_name, tensor in merge_tp_shards(slot_rule, [s[name] for s in states]).items():
                    stacked.setdefault(hf_name, {})[slot_rule.expert] = tensor
                    counts[hf_name] = slot_rule.experts
    for hf_name, matrices in stacked.items():
        if len(matrices) != counts[hf_name]:
            raise ValueError(
                f"{hf_name}: adapters of {len(matrices)} of {counts[hf_name]} experts (merge at EP 1)"
            )
        out[hf_name] = torch.stack([matrices[e] for e in range(counts[hf_name])])
    return out
