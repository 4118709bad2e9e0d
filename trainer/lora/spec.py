"""What a LoRA run adapts: rank, alpha, dropout and the target modules, from the flags or from a PEFT adapter
folder's ``adapter_config.json``, and which HF linear modules of a model the targets name (as peft matches
them: a name equal to the module's, or a dotted suffix of it; a regex string from a PEFT file must match the
whole name).

A mixture of experts' experts are 3-D parameters in transformers 5 (``mlp.experts.gate_up_proj`` [experts,
2 * ffn, hidden], ``mlp.experts.down_proj``), which peft adapts through ``target_parameters``: a target that
contains ``experts.`` and ends at such a parameter (``experts.gate_up_proj``, ``mlp.experts.down_proj``) names it
(:func:`split_targets`), every other target names linear modules."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmpack.trainer.models.hf_weights import Rule, SafetensorsReader

# megatron-core's linear layers that LoRA adapts, by the last part of their module name
LINEAR_LAYERS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# transformers 5's 3-D expert parameters, in the order the experts module defines them (peft nests its
# adapters of one module in that order: the first one innermost), by the megatron-core layer they make
EXPERT_PARAMETERS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}
LORA = "lora"  # the attribute a LoRA layer hangs under on the layer it adapts
DEFAULT_TARGETS = ("q_proj", "v_proj")  # peft's default for the Qwen2 language models
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# adapter_config.json keys whose non-default values mmpack does not implement: key -> the value it takes
_UNSUPPORTED = {
    "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
    "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
}  # fmt: skip


@dataclass(kw_only=True, frozen=True)
class LoraSpec:
    """One run's LoRA: ``targets`` a tuple of names (peft's list form) or one regex (peft's string form) of
    linear modules; ``parameters``: names of experts' 3-D parameters (peft's ``target_parameters``);
    ``adapter_dir``: a PEFT folder whose weights start the adapters (None: A drawn, B zero, as peft does)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] | str = DEFAULT_TARGETS
    parameters: tuple[str, ...] = ()
    adapter_dir: str | None = None

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"--lora-rank must be >= 1, got {self.rank}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        if not self.targets and not self.parameters:
            raise ValueError("--lora-target-modules names no module")
        if self.parameters and self.dropout:
            raise ValueError(
                f"--lora-dropout {self.dropout}: adapters on experts ({', '.join(self.parameters)}) take no "
                "dropout (peft's adapters of 3-D parameters have none); give --lora-dropout 0"
            )

    @property
    def scale(self) -> float:
        """peft's scaling of the update B A x: alpha / rank."""
        return self.alpha / self.rank

    def matches(self, hf_module: str) -> bool:
        """Whether the targets name the HF module ``hf_module`` (either of its two spellings)."""
        return bool(self.targets) and any(
            _target_matches(self.targets, name) for name in spellings(hf_module)
        )

    def matches_parameter(self, hf_parameter: str) -> bool:
        """Whether the parameter targets name the experts' 3-D HF parameter ``hf_parameter``."""
        return any(_target_matches(self.parameters, name) for name in spellings(hf_parameter))


def spellings(hf_module: str) -> tuple[str, ...]:
    """The names of one HF module as ``save_pretrained`` writes it (``model.layers.0...``) and as transformers 5
    holds it in memory (``model.language_model.layers.0...``), which peft matches and saves."""
    names = [SafetensorsReader.canonical(hf_module)]
    for old, new in SafetensorsReader.ALIASES:
        if names[0].startswith(old):
            names.append(new + names[0][len(old) :])
            break
    return tuple(names)


def _target_matches(targets: tuple[str, ...] | str, name: str) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def split_targets(targets: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(linear module targets, expert parameter targets) of the names of ``--lora-target-modules``: a name that
    contains ``experts.`` and ends at an expert parameter (``experts.gate_up_proj``) names the parameter."""
    params = tuple(t for t in targets if is_parameter_target(t))
    return tuple(t for t in targets if t not in params), params


def is_parameter_target(target: str) -> bool:
    """Whether a target names the experts' 3-D parameters (see :func:`split_targets`)."""
    return "experts." in target and target.rsplit(".", 1)[-1] in EXPERT_PARAMETERS.values()


def parse_targets(text: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``q_proj,v_proj`` (or several words) -> ("q_proj", "v_proj")."""
    words = text.split(",") if isinstance(text, str) else [w for t in text for w in t.split(",")]
    return tuple(dict.fromkeys(w.strip() for w in words if w.strip()))


def lora_modules(rules: dict[str, Rule]) -> dict[str, Rule]:
    """megatron-core module name -> the rule of its weight, for every linear layer LoRA can adapt (experts
    excepted: transformers holds them as 3-D tensors, not linear modules)."""
    return {
        name[: -len(".weight")]: rule
        for name, rule in rules.items()
        if name.endswith(".weight")
        and name[: -len(".weight")].rsplit(".", 1)[-1] in LINEAR_LAYERS
        and rule.expert < 0
        and ".experts." not in name
    }


def expert_layers(rules: dict[str, Rule]) -> dict[str, tuple[Rule, str]]:
    """megatron-core module name -> (the rule of its weight, the HF 3-D parameter it is a matrix of) for every
    expert's ``linear_fc1`` / ``linear_fc2`` (experts numbered globally). The parameter is transformers 5's
    in-memory one also where the files hold each expert's own tensors (``experts.0.gate_proj``): transformers
    stacks them on load, and peft adapts what it holds."""
    out = {}
    for name, rule in rules.items():
        layer = name.removesuffix(".weight")
        kind = layer.rsplit(".", 1)[-1]
        if rule.expert < 0 or not name.endswith(".weight") or kind not in EXPERT_PARAMETERS:
            continue
        hf = rule.hf[0]
        out[layer] = (rule, hf[: hf.index(".experts.") + len(".experts.")] + EXPERT_PARAMETERS[kind])
    return out


def expert_names(rules: dict[str, Rule]) -> set[str]:
    """The HF names of a mixture of experts' expert tensors (``...mlp.experts.gate_up_proj``, or each expert's
    ``...mlp.experts.0.down_proj``) and of the ``...mlp.experts`` modules holding them."""
    names = set()
    for name, rule in rules.items():
        if rule.expert >= 0 or ".experts." in name:
            for hf in rule.hf:
                hf = hf.removesuffix(".weight")
                names |= {hf, hf[: hf.index(".experts.") + len(".experts")]} if ".experts." in hf else {hf}
    return names


def hf_modules(rule: Rule) -> tuple[str, ...]:
    """The HF linear modules a megatron-core layer's weight is made of (``...q_proj``, ``...k_proj``, ...)."""
    return tuple(name[: -len(".weight")] for name in rule.hf)


def short_name(hf_module: str) -> str:
    """How a target names the module in the list of valid names: its last part (``q_proj``), with its parent
    where that is a number (``mlp.0``)."""
    parts = hf_module.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]


def check_targets(spec: LoraSpec, rules: dict[str, Rule], where: str) -> None:
    """Every target names at least one linear module of the whole model (``rules``: its HF rules with every
    part), every parameter target an expert parameter; one ValueError listing the valid names otherwise, which
    says so where a module target names only a mixture of experts' experts (``where``: the model, for the
    message)."""
    params = sorted({p for _, p in expert_layers(rules).values()})
    for target in spec.parameters:
        if not any(_target_matches((target,), n) for p in params for n in spellings(p)):
            valid = sorted({".".join(p.split(".")[-2:]) for p in params})
            raise ValueError(
                f"--lora-target-modules: {target} names no expert parameter of {where}; "
                + (f"valid names: {', '.join(valid)}" if valid else "it has no experts")
            )
    if not spec.targets:
        return
    modules = [m for rule in lora_modules(rules).values() for m in hf_modules(rule)]
    valid = sorted({short_name(m) for m in modules})
    given = [spec.targets] if isinstance(spec.targets, str) else list(spec.targets)
    unmatched = [t for t in given if not any(_target_matches(t if isinstance(spec.targets, str) else (t,), n)
                                             for m in modules for n in spellings(m))]  # fmt: skip
    experts = [t for t in unmatched if any(_target_matches(t if isinstance(spec.targets, str) else (t,), n)
                                           for m in expert_names(rules) for n in spellings(m))]  # fmt: skip
    if experts:
        raise ValueError(
            f"--lora-target-modules: {', '.join(experts)} name(s) the experts of {where}, which transformers holds "
            f"as 3-D parameters, not linear modules: name those as peft's target_parameters do "
            f"(experts.gate_up_proj, experts.down_proj); valid module names: {', '.join(valid)}"
        )
    if unmatched:
        raise ValueError(
            f"--lora-target-modules: {', '.join(unmatched)} name(s) no linear module of {where}; valid names: "
            f"{', '.join(valid)} (or a dotted suffix of a module name, e.g. layers.0.self_attn.q_proj)"
        )
    # peft would adapt these too (a convolution, the embedding, the output layer): the runs would differ
    others = {name.rsplit(".", 1)[0] for rule in rules.values() for name in rule.hf} - set(modules)
    clash = sorted({f"{t} ({m})" for t in given for m in others for n in spellings(m)
                    if _target_matches(t if isinstance(spec.targets, str) else (t,), n)})  # fmt: skip
    if clash:
        raise ValueError(
            f"--lora-target-modules: {', '.join(clash[:3])} also name(s) a module mmpack does not adapt (peft "
            f"would); name the linear modules more precisely (e.g. attn.proj), valid names: {', '.join(valid)}"
        )


def read_adapter_config(folder: str) -> dict[str, Any]:
    """A PEFT folder's ``adapter_config.json``, checked: a LoRA adapter of features mmpack implements."""
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        raise ValueError(f"--lora-adapter {folder}: no {ADAPTER_CONFIG} (give a folder written by peft's save_pretrained)")  # fmt: skip
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")  # type: ignore[union-attr]
    for key, ok in _UNSUPPORTED.items():
        if config.get(key, ok) not in (ok, None, [], {}):
            raise ValueError(
                f"{path}: {key} {config[key]!r} is not supported (mmpack's LoRA takes {key} {ok!r})"
            )
    for key in ("r", "lora_alpha"):
        if key not in config:
            raise ValueError(f"{path}: no {key!r}")
    if not config.get("target_modules") and not config.get("target_parameters"):
        raise ValueError(f"{path}: no 'target_modules' (nor 'target_parameters')")
    bad = [t for t in config.get("target_parameters") or [] if not is_parameter_target(t)]
    if bad:
        raise ValueError(
            f"{path}: target_parameters {', '.join(bad)} are not experts' parameters (mmpack adapts "
            "experts.gate_up_proj and experts.down_proj)"
        )
    return config


def resolve_spec(
    *, rank: int | None, alpha: float | None, dropout: float | None, targets: tuple[str, ...] | None,
    adapter: str | None,
) -> LoraSpec | None:  # fmt: skip
    """The run's LoRA from its flags (None: no LoRA); with ``adapter`` its ``adapter_config.json`` gives rank,
    alpha, dropout and targets, and a flag that contradicts it is refused."""
    if adapter is None:
        if rank is None:
            if alpha is not None or dropout is not None or targets is not None:
                raise ValueError(
                    "--lora-alpha, --lora-dropout and --lora-target-modules need --lora-rank (or --lora-adapter)"
                )
            return None
        modules, params = split_targets(targets or DEFAULT_TARGETS)
        return LoraSpec(rank=rank, alpha=8.0 if alpha is None else alpha, dropout=dropout or 0.0,
                        targets=modules, parameters=params)  # fmt: skip
    config = read_adapter_config(adapter)
    found = config.get("target_modules") or ()
    file_targets = found if isinstance(found, str) else tuple(sorted(found))
    file_params = tuple(sorted(config.get("target_parameters") or ()))
    flag_targets = None if not targets else tuple(sorted(targets))
    file_all = (file_targets if isinstance(file_targets, str) or not file_params
                else tuple(sorted(file_targets + file_params)))  # fmt: skip
    from_file = {"--lora-rank": (rank, config["r"]), "--lora-alpha": (alpha, config["lora_alpha"]),
                 "--lora-target-modules": (flag_targets, file_all)}  # fmt: skip
    for flag, (given, there) in from_file.items():
        if given is not None and given != there:
            raise ValueError(f"{flag} {given} contradicts --lora-adapter {adapter} ({ADAPTER_CONFIG}: {there}); drop the flag")  # fmt: skip
    return LoraSpec(
        rank=int(config["r"]), alpha=float(config["lora_alpha"]),
        dropout=float(config.get("lora_dropout") or 0.0) if dropout is None else dropout,
        targets=file_targets, parameters=file_params, adapter_dir=adapter,
    )  # fmt: skip


def is_lora_param(name: str) -> bool:
    """Whether a stage-model parameter name is a LoRA adapter's (``<layer>.lora.lora_A.<slot>``)."""
    return f".{LORA}.lora_A." in name or f".{LORA}.lora_B." in name
