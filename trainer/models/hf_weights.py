"""HuggingFace <-> megatron-core weights, for every model family.

A family names, for every parameter of one pipeline stage, the HuggingFace tensors it is made of and how
tensor parallelism cuts it (:class:`Rule`, from its ``part_rules``). With those rules a rank reads only its
own slice from the safetensors files (:func:`load_stage_weights`, ``safe_open`` + ``get_slice``), and TP
shards go back to HF tensors (:func:`merge_tp_shards`). Layouts: megatron-core's fused QKV holds, per query
group, the group's query heads then its key and value head; its SwiGLU ``linear_fc1`` holds this rank's gate
rows then its up rows.

Files with the legacy Qwen layout (``model.layers.*``, ``visual.*``) and with transformers 5's
(``model.language_model.*``, ``model.visual.*``) are both read, whichever the rules name.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Rule:
    """How one megatron-core parameter is made of HF tensors.

    kind: ``copy`` (one tensor, cut along ``split`` or replicated when None), ``qkv`` (separate q/k/v),
    ``fused_qkv`` (one [q; k; v] tensor, the vision towers'), ``glu`` (gate and up projections),
    ``fused_glu`` (one [gate; up] tensor), ``kv_heads`` (the rows of ``groups`` key or value heads of
    ``head_dim``: cut by whole heads where TP divides ``groups``, else whole on every rank).

    An expert's parameter (``expert`` >= 0) is matrix ``expert`` of a 3-D HF tensor [experts, a, b]
    (transformers' ``gate_up_proj`` / ``down_proj``) of ``experts`` matrices whose rows number ``rows`` in
    transformers' layout (a file holding each matrix transposed, as Qwen's own MoE checkpoints do, is read
    too); with ``experts`` 0 it is the expert's own 2-D HF tensors. Either is cut over the
    expert-tensor-parallel ranks instead of the tensor-parallel ones.
    """

    kind: str
    hf: tuple[str, ...]
    split: int | None = 0
    heads: int = 0
    groups: int = 0
    head_dim: int = 0
    expert: int = -1
    experts: int = 0
    rows: int = 0


@dataclass(kw_only=True, frozen=True)
class ExpertSlice:
    """Which experts a rank holds (expert-parallel rank of size) and how they are cut (expert-tensor-parallel
    rank of size); None where they are given: EP 1 and the tensor-parallel ranks."""

    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int | None = None
    etp_size: int | None = None

    def ranks(self, rule: Rule, tp_rank: int, tp_size: int) -> tuple[int, int]:
        """(rank, size) that cut the parameter of ``rule``."""
        if rule.expert < 0 or self.etp_size is None:
            return tp_rank, tp_size
        return int(self.etp_rank or 0), self.etp_size


# (arch, first, last, layers) -> rules of that part of the model: a family's `part_rules`
PartRules = Callable[..., dict[str, Rule]]


def layers_of_stage(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """(first global layer, layer count) of a pipeline stage: megatron-core's even split."""
    if num_layers % pp_size:
        raise ValueError(f"{num_layers} language layers cannot be split evenly over PP {pp_size}")
    count = num_layers // pp_size
    return pp_rank * count, count


def stage_rules(
    part_rules: PartRules, arch: Any, pp_rank: int, pp_size: int, layers: tuple[int, int] | None = None
) -> dict[str, Rule]:
    """megatron-core parameter name (relative to the stage's model) -> :class:`Rule`; ``layers`` (first
    global layer, count) of an uneven split, else the even one."""
    return part_rules(
        arch,
        first=pp_rank == 0,
        last=pp_rank == pp_size - 1,
        layers=layers or layers_of_stage(arch.num_layers, pp_rank, pp_size),
    )


def model_rules(part_rules: PartRules, arch: Any, model: torch.nn.Module) -> dict[str, Rule]:
    """The rules of a built stage or model chunk (interleaved pipeline): its ends and layers as built."""
    bare = unwrapped(model)
    return part_rules(arch, first=bare.pre_process, last=bare.post_process, layers=built_layers(model))


def output_rules(
    *, first: bool, last: bool, tied: bool, norm: str, embedding: str, lm_head: str = "lm_head.weight"
) -> dict[str, Rule]:
    """The rules of the word embedding (``first``) and of the final norm and output layer (``last``) of a
    megatron-core ``GPTModel`` named ``language_model``; tied, the output layer on another stage than the
    embedding is a copy of it."""
    rules: dict[str, Rule] = {}
    if first:
        rules["language_model.embedding.word_embeddings.weight"] = Rule("copy", (embedding,), 0)
    if last:
        rules["language_model.decoder.final_layernorm.weight"] = Rule("copy", (norm,), None)
        if not tied:
            rules["language_model.output_layer.weight"] = Rule("copy", (lm_head,), 0)
        elif not first:
            rules["language_model.output_layer.weight"] = Rule("copy", (embedding,), 0)
    return rules


def mlp_rules(mc: str, fc1: str, fc2: str) -> dict[str, Rule]:
    """A plain MLP with biases (megatron-core's ``linear_fc1`` -> ``linear_fc2`` under ``mc``; ``fc1``/``fc2``:
    the HF module names): fc1 cut over TP by rows (bias too), fc2 by columns (bias whole)."""
    return {
        mc + "linear_fc1.weight": Rule("copy", (fc1 + ".weight",), 0),
        mc + "linear_fc1.bias": Rule("copy", (fc1 + ".bias",), 0),
        mc + "linear_fc2.weight": Rule("copy", (fc2 + ".weight",), 1),
        mc + "linear_fc2.bias": Rule("copy", (fc2 + ".bias",), None),
    }


def vision_layer_rules(
    mc: str, hf: str, attn: dict[str, int], *, qkv: str, proj: str, fc1: str, fc2: str, norms: tuple[str, str]
) -> dict[str, Rule]:
    """The rules of one layer of a LayerNorm vision tower with biases everywhere (a fused [q; k; v], a
    plain fc1 -> fc2 MLP): megatron-core names under ``mc``, HF names under ``hf`` (``qkv`` ... ``fc2``:
    the HF module names, ``norms``: those of the norms before attention and before the MLP); ``attn``: the
    fused QKV's heads, groups and head_dim."""
    rules = {
        mc + "self_attention.linear_qkv.weight": Rule("fused_qkv", (f"{hf}{qkv}.weight",), **attn),
        mc + "self_attention.linear_qkv.bias": Rule("fused_qkv", (f"{hf}{qkv}.bias",), **attn),
        mc + "self_attention.linear_proj.weight": Rule("copy", (f"{hf}{proj}.weight",), 1),
        mc + "self_attention.linear_proj.bias": Rule("copy", (f"{hf}{proj}.bias",), None),
    } | mlp_rules(mc + "mlp.", hf + fc1, hf + fc2)
    for norm, ours in zip(norms, ("input_layernorm", "pre_mlp_layernorm"), strict=True):
        for p in ("weight", "bias"):
            rules[f"{mc}{ours}.{p}"] = Rule("copy", (f"{hf}{norm}.{p}",), None)
    return rules


# -- reading slices --------------------------------------------------------------------------------------


class SafetensorsReader:
    """Reads (slices of) tensors of a ``save_pretrained`` folder by HF name, opening each file once."""

    ALIASES = (("model.layers.", "model.language_model.layers."), ("model.embed_tokens.", "model.language_model.embed_tokens."),
               ("model.norm.", "model.language_model.norm."), ("visual.", "model.visual."))  # fmt: skip

    def __init__(self, model_dir: str | Path, stack: ExitStack) -> None:
        from safetensors import safe_open

        root = Path(model_dir)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (root / "model.safetensors").is_file():
            weight_map = {}
        else:
            raise ValueError(
                f"{model_dir} has no model.safetensors(.index.json): give a save_pretrained folder"
            )
        files = sorted(set(weight_map.values())) or ["model.safetensors"]
        self.handles = {f: stack.enter_context(safe_open(str(root / f), framework="pt")) for f in files}
        self.where = {k: f for f, h in self.handles.items() for k in h.keys()}  # noqa: SIM118 (safe_open handles are not dicts)
        self.root = root

    def _resolve(self, name: str) -> str:
        if name in self.where:
            return name
        for old, new in self.ALIASES:
            for a, b in ((old, new), (new, old)):
                if name.startswith(a) and b + name[len(a) :] in self.where:
                    return b + name[len(a) :]
        raise ValueError(f"{self.root}: tensor {name} not found in the safetensors files")

    def shape(self, name: str) -> list[int]:
        key = self._resolve(name)
        return list(self.handles[self.where[key]].get_slice(key).get_shape())

    def dtypes(self) -> dict[str, str]:
        """Every tensor of the files by its ``save_pretrained`` name (aliases undone): its safetensors
        dtype ("F32", "BF16", "I8", ...)."""
        return {self.canonical(k): self.handles[f].get_slice(k).get_dtype() for k, f in self.where.items()}

    @classmethod
    def canonical(cls, key: str) -> str:
        """The ``save_pretrained`` name of a file's tensor name (``model.language_model.*`` -> ``model.*``)."""
        for old, new in cls.ALIASES:
            if key.startswith(new):
                return old + key[len(new) :]
        return key

    def read(
        self, name: str, rows: slice | None = None, cols: slice | None = None, expert: int | None = None
    ) -> torch.Tensor:
        key = self._resolve(name)
        sl = self.handles[self.where[key]].get_slice(key)
        lead = () if expert is None else (expert,)
        if cols is not None:
            return sl[(*lead, rows or slice(None), cols)]
        return sl[(*lead, rows)] if rows is not None else sl[(*lead, slice(None))]


# HF names of output projections (the residual branches' last linear layers): drawn with a smaller std
_OUT_PROJECTIONS = ("o_proj", "down_proj", "attn.proj", "mlp.2", "linear_fc2")


class RandomHFWeights:
    """Stands in for :class:`SafetensorsReader` with random HF tensors drawn from (seed, HF name), so that
    a random model is the same under every TP x PP layout (megatron-core's own init draws per shard, and
    fused QKV / SwiGLU shards are not slices of one layout-free tensor)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int, std: float, num_layers: int) -> None:
        self.shapes, self.seed, self.std, self.num_layers = shapes, seed, std, num_layers
        self._cache: dict[str, torch.Tensor] = {}

    def shape(self, name: str) -> list[int]:
        return list(self.shapes[name])

    def _full(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            shape = self.shapes[name]
            if name.endswith("bias"):
                full = torch.zeros(shape)
            elif "norm" in name or "ln_q" in name:
                full = torch.ones(shape)
            else:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
                out_proj = any(k in name for k in _OUT_PROJECTIONS)
                std = self.std / (2.0 * self.num_layers) ** 0.5 if out_proj else self.std
                full = torch.randn(shape, generator=gen) * std
            self._cache[name] = full
        return self._cache[name]

    def read(
        self, name: str, rows: slice | None = None, cols: slice | None = None, expert: int | None = None
    ) -> torch.Tensor:
        full = self._full(name)
        full = full[expert] if expert is not None else full
        full = full[rows] if rows is not None else full
        return full[:, cols] if cols is not None else full


class ExpertMatrix:
    """One expert's matrix of a 3-D HF tensor, read like a 2-D tensor in transformers' layout (see
    :class:`Rule`): ``reader`` is a :class:`SafetensorsReader` or :class:`RandomHFWeights`."""

    def __init__(self, reader: Any, rule: Rule) -> None:
        self.reader, self.expert, self.rows = reader, rule.expert, rule.rows

    def _transposed(self, name: str) -> bool:
        _, a, b = self.reader.shape(name)
        return a != self.rows and b == self.rows

    def shape(self, name: str) -> list[int]:
        _, a, b = self.reader.shape(name)
        return [b, a] if self._transposed(name) else [a, b]

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if self._transposed(name):
            return self.reader.read(name, rows=cols, cols=rows, expert=self.expert).T.contiguous()
        return self.reader.read(name, rows=rows, cols=cols, expert=self.expert)


def hf_shapes(rule: Rule, param_shape: tuple[int, ...], tp_size: int) -> dict[str, tuple[int, ...]]:
    """Full shapes of the HF tensors behind a megatron-core parameter of ``param_shape`` on one TP rank."""
    if rule.expert >= 0 and rule.experts:
        inner = hf_shapes(Rule(rule.kind, rule.hf, rule.split), param_shape, tp_size)
        return {name: (rule.experts, *shape) for name, shape in inner.items()}
    rest = tuple(param_shape[1:])
    if rule.kind == "fused_glu":
        return {rule.hf[0]: (param_shape[0] * tp_size, *rest)}
    if rule.kind == "copy":
        if rule.split is None:
            return {rule.hf[0]: tuple(param_shape)}
        full = list(param_shape)
        full[rule.split] *= tp_size
        return {rule.hf[0]: tuple(full)}
    if rule.kind == "glu":
        return {name: (param_shape[0] // 2 * tp_size, *rest) for name in rule.hf}
    if rule.kind == "kv_heads":
        return {rule.hf[0]: (rule.groups * rule.head_dim, *rest)}
    q_rows, kv_rows = rule.heads * rule.head_dim, rule.groups * rule.head_dim
    if rule.kind == "qkv":
        return dict(zip(rule.hf, ((q_rows, *rest), (kv_rows, *rest), (kv_rows, *rest)), strict=True))
    return {rule.hf[0]: (q_rows + 2 * kv_rows, *rest)}


# Transformer Engine's layer spec fuses the pre-attention and pre-MLP norms into the next linear layer; the
# rules name them as the local spec does (as megatron-core's checkpoint key map does).
TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def local_param_name(name: str) -> str:
    """The local-spec name of a parameter (TE's fused norm weights renamed, all others unchanged)."""
    for fused, local in TE_FUSED_NORMS.items():
        if name.endswith("." + fused):
            return name[: -len(fused)] + local
    return name


def built_layers(model: torch.nn.Module) -> tuple[int, int]:
    """(first global layer, count) of the language layers a stage's model holds: megatron-core numbers its
    layers globally, also under an uneven pipeline split."""
    language_model: Any = unwrapped(model).language_model
    layers = language_model.decoder.layers
    return (layers[0].layer_number - 1 if len(layers) else 0, len(layers))


def unwrapped(model: torch.nn.Module) -> Any:
    """The stage model inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module  # type: ignore[assignment]
    return model


@contextmanager
def open_hf_weights(model_dir: str | Path) -> Iterator[SafetensorsReader]:
    with ExitStack() as stack:
        yield SafetensorsReader(model_dir, stack)


def _part(n: int, rank: int, size: int) -> slice:
    if n % size:
        raise ValueError(f"a dimension of {n} cannot be split over TP {size}")
    return slice(rank * n // size, (rank + 1) * n // size)


def _interleave_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[q; k; v] rows of ``groups`` query groups -> megatron-core's per-group [q_g, k_g, v_g] layout."""
    parts = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def read_shard(reader: Any, rule: Rule, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of the parameter described by ``rule``, reading only that part from disk
    (``reader``: a :class:`SafetensorsReader` or :class:`RandomHFWeights`)."""
    if rule.expert >= 0 and rule.experts:
        reader = ExpertMatrix(reader, rule)
    if rule.kind == "fused_glu":  # this rank's gate rows, then its up rows
        half = reader.shape(rule.hf[0])[0] // 2
        part = _part(half, tp_rank, tp_size)
        gate_up = (part, slice(part.start + half, part.stop + half))
        return torch.cat([reader.read(rule.hf[0], rows=r) for r in gate_up])
    if rule.kind == "copy":
        name = rule.hf[0]
        if rule.split is None:
            return reader.read(name)
        part = _part(reader.shape(name)[rule.split], tp_rank, tp_size)
        return reader.read(name, rows=part) if rule.split == 0 else reader.read(name, cols=part)
    if rule.kind == "glu":
        n = reader.shape(rule.hf[0])[0]
        return torch.cat([reader.read(name, rows=_part(n, tp_rank, tp_size)) for name in rule.hf])
    if rule.kind == "kv_heads":
        if rule.groups % tp_size:
            return reader.read(rule.hf[0])
        heads = _part(rule.groups, tp_rank, tp_size)
        return reader.read(rule.hf[0], rows=slice(heads.start * rule.head_dim, heads.stop * rule.head_dim))
    groups = _part(rule.groups, tp_rank, tp_size)
    per_group = rule.heads // rule.groups * rule.head_dim
    q_rows = slice(groups.start * per_group, groups.stop * per_group)
    kv_rows = slice(groups.start * rule.head_dim, groups.stop * rule.head_dim)
    local = groups.stop - groups.start
    if rule.kind == "qkv":
        q, k, v = (reader.read(n, rows=r) for n, r in zip(rule.hf, (q_rows, kv_rows, kv_rows), strict=True))
        return _interleave_groups(q, k, v, local)
    # fused_qkv: one tensor of rows [q (heads*hd); k; v] with as many groups as heads
    width = rule.heads * rule.head_dim
    q, k, v = (
        reader.read(rule.hf[0], rows=slice(r.start + i * width, r.stop + i * width))
        for i, r in enumerate((q_rows, kv_rows, kv_rows))
    )
    return _interleave_groups(q, k, v, local)


def merge_tp_shards(rule: Rule, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF tensors of one megatron-core parameter from its TP shards (inverse of :func:`read_shard`)."""
    if rule.kind == "copy":
        return {rule.hf[0]: shards[0] if rule.split is None else torch.cat(shards, dim=rule.split)}
    if rule.kind == "kv_heads":
        return {rule.hf[0]: torch.cat(shards) if rule.groups % len(shards) == 0 else shards[0]}
    if rule.kind in ("glu", "fused_glu"):
        halves = [s.chunk(2, dim=0) for s in shards]
        parts = [torch.cat([h[i] for h in halves]) for i in range(2)]
        if rule.kind == "fused_glu":
            return {rule.hf[0]: torch.cat(parts)}
        return dict(zip(rule.hf, parts, strict=True))
    per_group_q = rule.heads // rule.groups * rule.head_dim
    local = rule.groups // len(shards)
    q, k, v = [], [], []
    for s in shards:
        g = s.reshape(local, per_group_q + 2 * rule.head_dim, *s.shape[1:])
        a, b, c = g.split([per_group_q, rule.head_dim, rule.head_dim], dim=1)
        q.append(a.reshape(-1, *s.shape[1:]))
        k.append(b.reshape(-1, *s.shape[1:]))
        v.append(c.reshape(-1, *s.shape[1:]))
    parts = [torch.cat(x) for x in (q, k, v)]
    if rule.kind == "qkv":
        return dict(zip(rule.hf, parts, strict=True))
    return {rule.hf[0]: torch.cat(parts)}


# -- whole stages ---------------------------------------------------------------------------------------


def strip_wrappers(name: str) -> str:
    """A parameter name without the ``module.`` prefixes of DDP / Float16Module."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _stage_params(model: torch.nn.Module, experts: ExpertSlice | None) -> dict[str, torch.nn.Parameter]:
    """The stage's parameters by rule name: local-spec names, experts numbered globally (EP rank r of size
    n holds experts r * E / n onwards, megatron-core's order)."""
    params = {local_param_name(strip_wrappers(n)): p for n, p in model.named_parameters()}
    local = {int(m.group(1)) for n in params for m in [_LOCAL_EXPERT.search(n)] if m}
    if not local or experts is None or experts.ep_size == 1:
        return params
    offset = experts.ep_rank * (max(local) + 1)
    return {
        _LOCAL_EXPERT.sub(lambda m: f".local_experts.{offset + int(m.group(1))}.", n): p
        for n, p in params.items()
    }


@torch.no_grad()
def init_stage_random(
    part_rules: PartRules, model: torch.nn.Module, arch: Any, *, seed: int, std: float, tp_rank: int,
    tp_size: int, experts: ExpertSlice | None = None,
) -> None:  # fmt: skip
    """Random weights of a whole HF-layout model, of which this rank's stage (or model chunk) keeps its
    slices (layout-independent); ``experts``: this rank's experts (all, cut over TP, when None)."""
    rules = model_rules(part_rules, arch, model)
    params = _stage_params(model, experts)
    cut = experts or ExpertSlice()
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in params.items():
        shapes |= hf_shapes(rules[name], tuple(param.shape), cut.ranks(rules[name], tp_rank, tp_size)[1])
    reader = RandomHFWeights(shapes, seed, std, arch.num_layers)
    for name, param in params.items():
        param.copy_(read_shard(reader, rules[name], *cut.ranks(rules[name], tp_rank, tp_size)))


@torch.no_grad()
def load_stage_weights(
    part_rules: PartRules, model: torch.nn.Module, model_dir: str | Path, arch: Any, *, tp_rank: int,
    tp_size: int, experts: ExpertSlice | None = None,
) -> int:  # fmt: skip
    """Copies this rank's slice of the HF weights into ``model`` (one stage, or one model chunk of the
    interleaved pipeline; ``experts``: this rank's experts, all cut over TP when None); returns the
    tensors read.

    Every parameter must have a rule and the shapes must agree, else a ValueError names the tensor.
    """
    rules = model_rules(part_rules, arch, model)
    params = _stage_params(model, experts)
    cut = experts or ExpertSlice()
    unknown = sorted(set(params) - set(rules))
    if unknown:
        raise ValueError(f"no HF source for parameters {unknown[:5]} (model and rules disagree)")
    with open_hf_weights(model_dir) as reader:
        for name, param in params.items():
            shard = read_shard(reader, rules[name], *cut.ranks(rules[name], tp_rank, tp_size))
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(
                    f"{model_dir}: {rules[name].hf} gives {tuple(shard.shape)} for {name}, which is "
                    f"{tuple(param.shape)} here: config.json and the weights disagree"
                )
            param.copy_(shard.to(param.dtype))
    return len(params)


def stage_state_dict(
    part_rules: PartRules, model_dir: str | Path, arch: Any, *, tp_rank: int, tp_size: int, pp_rank: int,
    pp_size: int,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The megatron-core state dict of one (TP, PP) rank, made from HF weights without building the model."""
    rules = stage_rules(part_rules, arch, pp_rank, pp_size)
    with open_hf_weights(model_dir) as reader:
        return {name: read_shard(reader, rule, tp_rank, tp_size).contiguous() for name, rule in rules.items()}


def hf_state_dict(
    part_rules: PartRules, arch: Any, shards: dict[tuple[int, int], dict[str, Any]], tp_size: int,
    pp_size: int,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """HF tensors from the state dicts of every (tp_rank, pp_rank) of a checkpoint (all experts on each,
    cut over TP); the experts' matrices stacked in transformers' layout."""
    out: dict[str, torch.Tensor] = {}
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    for pp in range(pp_size):
        states = [{strip_wrappers(k): v for k, v in shards[(tp, pp)].items()} for tp in range(tp_size)]
        for name, rule in stage_rules(part_rules, arch, pp, pp_size).items():
            missing = [tp for tp in range(tp_size) if name not in states[tp]]
            if missing:
                raise ValueError(f"checkpoint stage {pp} has no {name} (TP ranks {missing})")
            for hf_name, tensor in merge_tp_shards(rule, [s[name] for s in states]).items():
                if rule.expert >= 0 and rule.experts:
                    stacked.setdefault(hf_name, {})[rule.expert] = tensor
                else:
                    out.setdefault(hf_name, tensor.contiguous())  # a tied output layer repeats the embedding
    for hf_name, matrices in stacked.items():
        out[hf_name] = torch.stack([matrices[e] for e in range(len(matrices))]).contiguous()
    return out
