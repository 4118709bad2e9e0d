"""Which parameters train (``--freeze-vision``, ``--freeze-llm``, ``--trainable-modules``).

A stage model's parameters fall into modules by name: ``adapter`` (the parameters under the model family's
``adapter_prefixes``: the patch merger / projector, and mergers like Qwen3-VL's DeepStack ones),
``vision_model`` (the rest of the vision tower), ``language_model`` (everything of the language model),
``embedding`` (its word embeddings) and ``output_layer`` (its output projection). With tied embeddings
``embedding`` and ``output_layer`` are the same weight (on the last pipeline stage a copy of it) and are named
by either word. Frozen parameters get ``requires_grad=False`` before megatron-core's DDP and optimizer are
built: DDP then gives them no gradient buffer and the optimizer no state, so they stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mmpack.trainer.lora.spec import is_lora_param

MODULES = ("adapter", "vision_model", "language_model", "embedding", "output_layer")


def parse_modules(text: str | Iterable[str] | None) -> tuple[str, ...] | None:
    """``"adapter,language_model"`` -> ("adapter", "language_model"); None stays None (everything trains).
    ValueError naming the unknown ones."""
    if text is None:
        return None
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text)]
    names = [n for n in names if n]
    unknown = sorted(set(names) - set(MODULES))
    if unknown or not names:
        raise ValueError(
            f"--trainable-modules: unknown module(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(MODULES)}"
        )
    return tuple(dict.fromkeys(names))


def modules_of(name: str, *, tied: bool, adapter_prefixes: tuple[str, ...]) -> set[str]:
    """The modules a stage-model parameter ``name`` belongs to (e.g. "vision.merger.ln_q.weight" ->
    {"adapter"} where the family's ``adapter_prefixes`` hold "vision.merger.")."""
    if name.startswith(adapter_prefixes):
        return {"adapter"}
    if name.startswith("vision."):
        return {"vision_model"}
    if name.startswith("language_model."):
        found = {"language_model"}
        if name.startswith("language_model.embedding.word_embeddings."):
            found |= {"embedding", "output_layer"} if tied else {"embedding"}
        elif name.startswith("language_model.output_layer."):
            found |= {"embedding", "output_layer"} if tied else {"output_layer"}
        return found
    raise ValueError(f"parameter {name!r} belongs to no known module ({', '.join(MODULES)})")


def trainable_set(
    trainable_modules: tuple[str, ...] | None, *, freeze_vision: bool, freeze_llm: bool
) -> tuple[set[str], set[str]]:
    """(modules that may train, modules that are frozen) from the flags."""
    allowed = set(trainable_modules) if trainable_modules is not None else set(MODULES)
    frozen = set()
    if freeze_vision:
        frozen.add("vision_model")
    if freeze_llm:
        frozen |= {"language_model", "embedding", "output_layer"}
    return allowed, frozen


def param_trains(
    name: str, *, tied: bool, adapter_prefixes: tuple[str, ...], allowed: set[str], frozen: set[str]
) -> bool:
    """A parameter trains when one of its modules is allowed and none of them is frozen."""
    mods = modules_of(name, tied=tied, adapter_prefixes=adapter_prefixes)
    return bool(mods & allowed) and not (mods & frozen)


def apply_freeze(
    model: torch.nn.Module,
    *,
    tied: bool,
    adapter_prefixes: tuple[str, ...],
    trainable_modules: tuple[str, ...] | None,
    freeze_vision: bool,
    freeze_llm: bool,
    lora: bool = False,
) -> None:
    """Sets ``requires_grad`` of every parameter of an unwrapped stage model from the flags
    (``adapter_prefixes``: the model family's). With ``lora`` the LoRA adapters train unless their module is
    frozen, and the base parameters only where ``trainable_modules`` names their module."""
    allowed, frozen = trainable_set(trainable_modules, freeze_vision=freeze_vision, freeze_llm=freeze_llm)
    if lora and trainable_modules is None:
        allowed = set()
    for name, param in model.named_parameters():
        if lora and is_lora_param(name):
            trains = not modules_of(name, tied=tied, adapter_prefixes=adapter_prefixes) & frozen
        else:
            trains = param_trains(
                name, tied=tied, adapter_prefixes=adapter_prefixes, allowed=allowed, frozen=frozen
            )
        param.requires_grad_(trains)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of this rank's stage, counting each TP-replicated parameter on TP rank
    0 only and the last stage's copy of tied embeddings not at all, so that a sum over the model-parallel
    group is the model's count."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    trainable = total = 0
    for param in model.parameters():
        if not (param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param)):
            continue
        total += param.numel()
        if param.requires_grad:
            trainable += param.numel()
    return trainable, total
