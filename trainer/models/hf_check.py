"""What a HuggingFace checkpoint must hold to be its ``config.json``'s model: every tensor ``save_pretrained``
writes for it, by name (and shape, where the family gives its table), in a float dtype, and nothing else.
Integer or quantized weights would be cast into nonsense, and a config.json with fewer layers than the files
would load part of the model without a word. Shapes a family gives no table for are checked against the
built parameters when the weights are loaded (``hf_weights.load_stage_weights``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mmpack.trainer.models.hf_weights import Rule

if TYPE_CHECKING:
    from mmpack.trainer.models.protocol import ModelArch

# Float formats the weights are read from (and cast to the run's dtype).
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
# Tensors some checkpoints carry that the model computes itself.
_IGNORED_SUFFIXES = (".inv_freq",)


def expected_hf_names(part_rules: Callable[..., dict[str, Rule]], arch: ModelArch) -> set[str]:
    """The HF tensor names the whole model (every stage at TP1 x PP1) is made of."""
    rules = part_rules(arch, first=True, last=True, layers=(0, arch.num_layers))
    return {name for rule in rules.values() for name in rule.hf}


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def check_weight_files(
    reader: Any, expected: set[str], shapes: dict[str, tuple[int, ...]] | None, *, arch: ModelArch
) -> None:
    """``reader`` (a ``SafetensorsReader``) holds exactly the tensors named in ``expected`` (with their
    ``shapes`` where given), all of float dtypes; ValueError in one line naming the first that is not."""
    dtypes: dict[str, str] = reader.dtypes()
    expected = {reader.canonical(n) for n in expected}  # the rules may name either spelling
    shapes = {reader.canonical(n): s for n, s in (shapes or {}).items()}
    for name, dtype in sorted(dtypes.items()):
        if dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{reader.root}: tensor {name} is {dtype}, not a float ({', '.join(FLOAT_DTYPES)}): quantized "
                "or integer weights cannot be trained from; give the unquantized checkpoint"
            )
    tolerated = {"lm_head.weight"} if arch.tie_word_embeddings else set()  # a copy of the tied embedding
    extra = sorted(n for n in set(dtypes) - expected - tolerated if not n.endswith(_IGNORED_SUFFIXES))
    missing = sorted(expected - set(dtypes))
    described = f"config.json ({arch.num_layers} language layers, {arch.vision.depth} vision blocks)"
    if extra or missing:
        what = [f"{len(extra)} tensors it does not describe ({_some(extra)})"] if extra else []
        what += [f"no {_some(missing)} ({len(missing)} missing)"] if missing else []
        raise ValueError(
            f"{reader.root}: {described} and the weights disagree: the files hold {' and '.join(what)}; give "
            "the config.json the weights were saved with"
        )
    for name, shape in sorted(shapes.items()):
        found = tuple(reader.shape(name))
        if found != shape:
            raise ValueError(
                f"{reader.root}: tensor {name} is {list(found)}, {described} gives {list(shape)}: config.json "
                "and the weights disagree; give the config.json the weights were saved with"
            )
