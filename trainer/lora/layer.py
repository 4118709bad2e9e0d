"""LoRA adapters on megatron-core's tensor-parallel linear layers, cut over TP like the layer they adapt.

Each HF linear module behind a megatron-core layer is one *slot* with its own A [r, in] and B [out, r], as peft
puts them on the transformers model: the fused ``linear_qkv`` of a language model holds the q_proj, k_proj and
v_proj slots, ``linear_fc1`` the gate_proj and up_proj slots. On a column-parallel layer A is whole on every TP
rank and B holds this rank's output rows (cut like the weight: the same HF rule, so the update lands in
megatron-core's per-group QKV and gate/up layout); on a row-parallel layer A holds this rank's input columns and
B is whole. The low-rank activations cross TP ranks with megatron-core's mappings, as the layer's own do:

- column-parallel: ``h = x A^T`` on the rank's tokens, then copied into the TP region (its gradient summed over
  TP in the backward pass), or gathered along the sequence under sequence parallelism (A's gradient, from this
  rank's tokens only, is then summed over TP by megatron-core's ``finalize_model_grads``: ``sequence_parallel``);
- row-parallel: ``h = x_local A_local^T`` is summed over TP (reduce-scattered along the sequence under SP, B's
  gradient then summed over TP like A's above).

The update is added to the layer's output by a forward hook, so the layer, its parameter names and the HF rules
stay as they are; the adapter parameters live under ``<layer>.lora.lora_A.<slot>`` / ``lora_B.<slot>``.

A mixture of experts' experts (megatron-core's ``SequentialMLP``: one MLP per local expert) get one slot per
expert layer, peft's adapter of transformers' 3-D parameter (``target_parameters``): expert e of
``experts.gate_up_proj`` has its own A [r, hidden] and B [2 * ffn, r] (rows 0 .. r-1 of expert e in peft's A
[r * experts, hidden], columns e, e + experts, ... of its B [2 * ffn, r * experts]), the update s * B A added to
the expert's fused [gate; up] (``linear_fc1``), likewise ``down_proj`` on ``linear_fc2``. An EP rank holds the
adapters of its experts; over expert-tensor-parallel ranks B (fc1) or A (fc2) is cut like the weight. The
tokens reach an expert already where it computes (megatron-core's dispatcher, which also sums the experts'
partial outputs and input gradients over those ranks), so the update takes no communication of its own; only
the factor whole on every expert-TP rank has its gradient, computed from the rank's part, summed over them.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as mtp
from megatron.core.transformer.utils import make_tp_sharded_tensor_for_checkpoint

from mmpack.trainer.lora.spec import (
    EXPERT_PARAMETERS,
    LORA,
    LoraSpec,
    expert_layers,
    hf_modules,
    lora_modules,
)
from mmpack.trainer.models.hf_weights import ExpertSlice, Rule, hf_shapes, read_shard


@dataclass(frozen=True)
class Slot:
    """One HF module of a layer: its key in the layer (``q_proj``), its HF name, and how its A and B are cut
    over TP (rules over the HF tensors ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``)."""

    key: str
    hf_module: str
    a_rule: Rule
    b_rule: Rule


def expert_slot(layer: str, rule: Rule, hf_parameter: str, experts: int) -> Slot:
    """The slot of an expert's ``linear_fc1`` / ``linear_fc2`` (``rule``: its weight's; ``experts``: how many
    matrices ``hf_parameter`` stacks), over the adapter tensors of the whole 3-D parameter in the per-expert
    layout ``<parameter>.lora_A.weight`` [experts, r, in] / ``lora_B.weight`` [experts, out, r]."""
    a, b = hf_parameter + ".lora_A.weight", hf_parameter + ".lora_B.weight"
    one = dict(expert=rule.expert, experts=experts)
    if layer.endswith("linear_fc1"):  # column-parallel: B's rows [gate; up] cut as the weight's
        a_rule, b_rule = Rule("copy", (a,), None, **one), Rule("fused_glu", (b,), **one)
    else:  # row-parallel
        a_rule, b_rule = Rule("copy", (a,), 1, **one), Rule("copy", (b,), None, **one)
    return Slot(EXPERT_PARAMETERS[layer.rsplit(".", 1)[-1]], hf_parameter, a_rule, b_rule)


def expert_slots(rules: dict[str, Rule]) -> dict[str, Slot]:
    """megatron-core expert layer name (experts numbered globally) -> its slot."""
    layers = expert_layers(rules)
    counts: dict[str, int] = {}
    for _, param in layers.values():
        counts[param] = counts.get(param, 0) + 1
    return {name: expert_slot(name, rule, param, counts[param]) for name, (rule, param) in layers.items()}


def layer_slots(rule: Rule) -> list[Slot]:
    """The slots of a linear layer whose weight has ``rule``."""
    slots = []
    for module in hf_modules(rule):
        a, b = module + ".lora_A.weight", module + ".lora_B.weight"
        if rule.kind == "fused_qkv":  # one HF tensor [q; k; v]: B's rows interleaved as the weight's
            b_rule = Rule("fused_qkv", (b,), heads=rule.heads, groups=rule.groups, head_dim=rule.head_dim)
            slots.append(Slot(module.rsplit(".", 1)[-1], module, Rule("copy", (a,), None), b_rule))
        elif rule.kind == "copy" and rule.split == 1:  # row-parallel
            slots.append(
                Slot(module.rsplit(".", 1)[-1], module, Rule("copy", (a,), 1), Rule("copy", (b,), None))
            )
        else:  # column-parallel (qkv, glu, copy along rows) or a whole linear layer
            split = None if rule.kind == "copy" and rule.split is None else 0
            slots.append(
                Slot(module.rsplit(".", 1)[-1], module, Rule("copy", (a,), None), Rule("copy", (b,), split))
            )
    return slots


class LoraLayer(torch.nn.Module):
    """The adapters of one megatron-core linear layer (see the module docstring); ``forward(x)`` is the update
    of the layer's output for its input ``x``."""

    def __init__(
        self, rule: Rule, slots: dict[str, tuple[torch.Tensor, torch.Tensor]], *, spec: LoraSpec,
        layout: str, tp_size: int, sequence_parallel: bool, group: Any, expert: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.rule, self.layout, self.tp_size, self.group, self.expert = rule, layout, tp_size, group, expert
        self.sequence_parallel = sequence_parallel and tp_size > 1 and not expert
        self.scale, self.dropout = spec.scale, spec.dropout
        self.lora_A = torch.nn.ParameterDict({k: torch.nn.Parameter(a) for k, (a, _) in slots.items()})
        self.lora_B = torch.nn.ParameterDict({k: torch.nn.Parameter(b) for k, (_, b) in slots.items()})
        for a, b in zip(self.lora_A.values(), self.lora_B.values(), strict=True):
            if layout == "column":
                mtp.set_tensor_model_parallel_attributes(b, True, 0, 1)
                a.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]
            elif layout == "row":
                mtp.set_tensor_model_parallel_attributes(a, True, 1, 1)
                b.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]
            if expert:  # reduced over the expert-data-parallel ranks, held by the expert optimizer
                a.allreduce = b.allreduce = False  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.expert:
            return self._expert_update(x)
        keys = list(self.lora_A)
        if self.dropout and self.training:
            x = lora_dropout(x, self.dropout, split=self.layout == "row" or self.sequence_parallel,
                             tp_size=self.tp_size)  # fmt: skip
        h = F.linear(x, torch.cat([self.lora_A[k] for k in keys]))
        if self.layout == "column":
            h = (mtp.gather_from_sequence_parallel_region(h, group=self.group) if self.sequence_parallel
                 else mtp.copy_to_tensor_model_parallel_region(h, group=self.group))  # fmt: skip
        elif self.layout == "row":
            h = (mtp.reduce_scatter_to_sequence_parallel_region(h, group=self.group) if self.sequence_parallel
                 else mtp.reduce_from_tensor_model_parallel_region(h, group=self.group))  # fmt: skip
        parts = h.split([self.lora_A[k].shape[0] for k in keys], dim=-1)
        deltas = {k: F.linear(p, self.lora_B[k]) * self.scale for k, p in zip(keys, parts, strict=True)}
        return self._assemble(deltas, h)

    def _expert_update(self, x: torch.Tensor) -> torch.Tensor:
        """An expert's update s * B A x on its tokens (see the module docstring)."""
        [key] = self.lora_A
        a, b = self.lora_A[key], self.lora_B[key]
        if self.tp_size > 1:  # the whole factor's gradient, from this rank's part, summed over expert TP
            if self.layout == "column":
                a = mtp.copy_to_tensor_model_parallel_region(a, group=self.group)
            else:
                b = mtp.copy_to_tensor_model_parallel_region(b, group=self.group)
        return F.linear(F.linear(x, a), b) * self.scale

    def _assemble(self, deltas: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """The slots' updates in the layer's output layout (zeros for the slots not adapted)."""
        rule = self.rule
        if rule.kind not in ("qkv", "glu"):
            return next(iter(deltas.values()))
        lead = h.shape[:-1]
        if rule.kind == "glu":
            rows = next(iter(deltas.values())).shape[-1]  # gate and up: as many rows each
            gate, up = (deltas.get(m.rsplit(".", 1)[-1], h.new_zeros(*lead, rows)) for m in hf_modules(rule))
            return torch.cat([gate, up], dim=-1)
        groups = rule.groups // self.tp_size
        parts = []
        for module, per_group in zip(hf_modules(rule), (rule.heads // rule.groups, 1, 1), strict=True):
            width = per_group * rule.head_dim
            part = deltas.get(module.rsplit(".", 1)[-1], h.new_zeros(*lead, groups * width))
            parts.append(part.reshape(*lead, groups, width))
        return torch.cat(parts, dim=-1).reshape(*lead, -1)


def lora_dropout(x: torch.Tensor, p: float, *, split: bool, tp_size: int) -> torch.Tensor:
    """peft's dropout of the adapter's input under tensor parallelism. A column-parallel layer's input is the
    same on every TP rank (without sequence parallelism), so its mask must be too: the default generator, which
    megatron-core seeds alike on the ranks of a TP group. A row-parallel layer's input is a slice of the hidden
    size on each rank, and with sequence parallelism a column-parallel one is a slice of the tokens: their masks
    are drawn from the model-parallel generator (seeded per TP rank), so that the slices' masks are independent,
    as one mask over the whole input is; the same mask on every slice would repeat one pattern."""
    if split and tp_size > 1:
        with mtp.get_cuda_rng_tracker().fork():
            return F.dropout(x, p)
    return F.dropout(x, p)


def _add_update(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Forward hook: the layer's (output, bias) with the LoRA update added to the output."""
    x = args[0] if args else next(iter(kwargs.values()))
    lora: LoraLayer = getattr(module, LORA)
    if hasattr(module, "layer_norm_weight"):  # Transformer Engine's norm fused into the linear layer
        x = _fused_norm(module, x)
    if lora.layout == "row" and not getattr(module, "input_is_parallel", True):
        x = mtp.scatter_to_tensor_model_parallel_region(x, group=lora.group)
    delta = lora(x)
    if lora.layout == "column" and getattr(module, "gather_output", False):
        delta = mtp.gather_from_tensor_model_parallel_region(delta, group=lora.group)
    if isinstance(output, tuple):
        return (output[0] + delta.to(output[0].dtype), *output[1:])
    return output + delta.to(output.dtype)


def _fused_norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    """The norm a Transformer Engine layer applies to its input before its linear part."""
    weight = module.layer_norm_weight + (1 if getattr(module, "zero_centered_gamma", False) else 0)
    if getattr(module, "normalization", "LayerNorm") == "RMSNorm":
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype) * weight
    return F.layer_norm(x, (x.shape[-1],), weight, getattr(module, "layer_norm_bias", None), module.eps)


class FullTensors:
    """Reads whole HF-layout tensors from a dict, as ``read_shard`` reads a safetensors folder."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def read(
        self, name: str, rows: slice | None = None, cols: slice | None = None, expert: int | None = None
    ) -> torch.Tensor:
        t = self.tensors[name]
        t = t[expert] if expert is not None else t
        t = t[rows] if rows is not None else t
        return t[:, cols] if cols is not None else t


def initial_tensors(slot: Slot, shape: tuple[int, ...], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A slot's whole A and B as peft initialises them (A Kaiming-uniform, B zero), A drawn from (seed, HF
    name), so that every TP x PP layout starts from the same adapters."""
    out_rows, in_cols = shape
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(slot.hf_module.encode()))
    bound = in_cols**-0.5  # kaiming_uniform_(a=sqrt(5)) on [rank, in]
    a = (torch.rand(rank, in_cols, generator=gen) * 2 - 1) * bound
    return {slot.a_rule.hf[0]: a, slot.b_rule.hf[0]: torch.zeros(out_rows, rank)}


def initial_expert_tensors(
    slot: Slot, out_rows: int, in_cols: int, rank: int, seed: int
) -> dict[str, torch.Tensor]:  # fmt: skip
    """An expert parameter's whole A [experts, r, in] and B [experts, out, r] as peft initialises its
    [r * experts, in] A (Kaiming-uniform) and B (zero), drawn from (seed, HF name) for every EP layout alike."""
    experts = slot.a_rule.experts
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(slot.hf_module.encode()))
    a = (torch.rand(experts * rank, in_cols, generator=gen) * 2 - 1) * in_cols**-0.5
    return {
        slot.a_rule.hf[0]: a.reshape(experts, rank, in_cols),
        slot.b_rule.hf[0]: torch.zeros(experts, out_rows, rank),
    }


def _local_experts(model: torch.nn.Module, rules: dict[str, Rule], experts: ExpertSlice) -> dict[str, str]:
    """Expert layer name as the rules number it (globally) -> its name in this EP rank's model, for the
    experts the rank holds (EP rank r of n holds experts r * E / n onwards, megatron-core's order)."""
    out = {}
    for name in expert_layers(rules):
        head, tail = name.split(".local_experts.", 1)
        expert, rest = tail.split(".", 1)
        count = len(model.get_submodule(head + ".local_experts"))  # type: ignore[arg-type]
        e = int(expert) - experts.ep_rank * count
        if 0 <= e < count:
            out[name] = f"{head}.local_experts.{e}.{rest}"
    return out


def _expert_slice() -> ExpertSlice:
    """This rank's experts from megatron-core's parallel state (all of them where it is not set up)."""
    if not ps.model_parallel_is_initialized():
        return ExpertSlice()
    return ExpertSlice(
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
    )  # fmt: skip


def add_expert_lora(
    model: torch.nn.Module, rules: dict[str, Rule], spec: LoraSpec, *, experts: ExpertSlice, seed: int,
    adapter: Any = None,
) -> int:  # fmt: skip
    """Puts LoRA adapters on the targeted expert layers this rank holds (see :func:`add_lora`); returns them."""
    slots = {
        name: slot for name, slot in expert_slots(rules).items() if spec.matches_parameter(slot.hf_module)
    }
    local = _local_experts(model, rules, experts)
    etp_rank, etp_size = int(experts.etp_rank or 0), experts.etp_size or 1
    count = 0
    for name, slot in slots.items():
        if name not in local:
            continue
        base: Any = model.get_submodule(local[name])
        weight: torch.Tensor = base.weight
        column = name.endswith("linear_fc1")
        out_rows, in_cols = (
            weight.shape[0] * (etp_size if column else 1),
            weight.shape[1] * (1 if column else etp_size),
        )
        reader = adapter or FullTensors(initial_expert_tensors(slot, out_rows, in_cols, spec.rank, seed))
        a, b = (read_shard(reader, r, etp_rank, etp_size) for r in (slot.a_rule, slot.b_rule))
        tensors = {slot.key: (a.to(weight.dtype).contiguous(), b.to(weight.dtype).contiguous())}
        # the expert-TP group also of size 1: the checkpoint cuts the adapters over it, not over TP
        group = ps.get_expert_tensor_parallel_group() if ps.model_parallel_is_initialized() else None
        lora = LoraLayer(rules[name + ".weight"], tensors, spec=spec, layout="column" if column else "row",
                         tp_size=etp_size, sequence_parallel=False, group=group, expert=True)  # fmt: skip
        _attach(base, lora.to(weight.device))
        count += 1
    return count


def _attach(base: Any, lora: LoraLayer) -> None:
    """Hangs ``lora`` on its layer: the update added by a forward hook, the adapters in its checkpoint."""
    base.add_module(LORA, lora)
    base.register_forward_hook(_add_update, with_kwargs=True)
    base.sharded_state_dict = partial(_sharded_with_lora, base, base.sharded_state_dict)


def add_lora(
    model: torch.nn.Module, rules: dict[str, Rule], spec: LoraSpec, *, tp_rank: int, tp_size: int, seed: int,
    adapter: Any = None, experts: ExpertSlice | None = None,
) -> int:  # fmt: skip
    """Puts LoRA adapters on the targeted linear layers of an unwrapped stage model and, with parameter targets,
    on its experts (``rules``: its HF rules; ``adapter``: a reader of a PEFT folder's whole tensors by HF name,
    else peft's initialisation; ``experts``: the rank's experts, else megatron-core's parallel state's);
    returns the layers adapted."""
    layers = lora_modules(rules)
    modules = dict(model.named_modules())
    count = 0
    if spec.parameters:
        count += add_expert_lora(
            model, rules, spec, experts=experts or _expert_slice(), seed=seed, adapter=adapter
        )
    for name, rule in layers.items():
        base = modules.get(name)
        slots = [s for s in layer_slots(rule) if spec.matches(s.hf_module)]
        if base is None or not slots:
            continue
        weight = base.weight
        shapes = hf_shapes(rule, tuple(weight.shape), tp_size)
        tensors = {}
        for slot in slots:
            full = shapes[slot.hf_module + ".weight"]
            reader = adapter or FullTensors(initial_tensors(slot, full, spec.rank, seed))
            a, b = (read_shard(reader, r, tp_rank, tp_size) for r in (slot.a_rule, slot.b_rule))
            tensors[slot.key] = (a.to(weight.dtype).contiguous(), b.to(weight.dtype).contiguous())
        layout = ("row" if rule.kind == "copy" and rule.split == 1
                  else "none" if rule.kind == "copy" and rule.split is None else "column")  # fmt: skip
        sp = bool(
            getattr(
                base, "sequence_parallel", getattr(getattr(base, "config", None), "sequence_parallel", False)
            )
        )
        group = getattr(base, "tp_group", None) or ps.get_tensor_model_parallel_group()
        lora = LoraLayer(
            rule, tensors, spec=spec, layout=layout, tp_size=tp_size, sequence_parallel=sp, group=group
        )
        _attach(base, lora.to(weight.device))
        count += 1
    return count


def _sharded_with_lora(
    base: torch.nn.Module, original: Callable[..., dict[str, Any]], prefix: str = "",
    sharded_offsets: tuple = (), metadata: dict | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The layer's own sharded state dict, its adapters cut over TP as they are (the layer's own method stores
    every tensor it does not know as replicated): a checkpoint then reshards them like the weight."""
    out = original(prefix, sharded_offsets, metadata)
    lora: LoraLayer = getattr(base, LORA)
    dp_cp = (metadata or {}).get("dp_cp_group") or ps.get_data_parallel_group(with_context_parallel=True)
    cut = {"column": ("lora_B", 0), "row": ("lora_A", 1)}.get(lora.layout)
    if cut is not None:
        which, axis = cut
        for key, param in getattr(lora, which).items():
            name = f"{prefix}{LORA}.{which}.{key}"
            out[name] = make_tp_sharded_tensor_for_checkpoint(
                param, name, axis, prepend_offsets=sharded_offsets, tp_group=lora.group, dp_cp_group=dp_cp
            )
    return out
