"""Trainer flags defined on their config fields: a field declared with :func:`flag` is its own command-line
flag, with the help text, name and text form in its metadata, the choices from its type (``Literal``) and the
config's default as the only default (argparse holds ``SUPPRESS``: a flag not given leaves its field to the
config). A field without a flag says why with :func:`not_a_flag`.

    num_layers: int = flag(4, help="language model layers")           # --num-layers N
    bias_swiglu_fusion: bool = flag(True, help="turn off fused ...")   # --no-bias-swiglu-fusion
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import MISSING, Field, dataclass
from typing import Any, Literal

FLAG = "mmpack_flag"  # a field's metadata key holding its FlagSpec
NOT_A_FLAG = "mmpack_not_a_flag"  # a field's metadata key holding why it has no flag of its own


@dataclass(frozen=True, kw_only=True)
class FlagSpec:
    """How a config field reads from the command line."""

    help: str
    name: str | None = None  # the flag without its dashes, when not the field's name
    parse: Callable[[str], Any] | None = None  # the flag's text form, when the type does not give it
    metavar: str | None = None
    nargs: str | None = None  # "+" / "*": several words, collected into the field's tuple
    convert: Callable[[Any], Any] | None = None  # parsed value -> field value
    choices: Callable[[], Sequence[str]] | None = None  # a registry's names, for a type that cannot list them


def flag(default: Any = MISSING, *, help: str, **spec: Any) -> Any:
    """A config field that is also a flag (``spec``: :class:`FlagSpec`'s other fields)."""
    return dataclasses.field(default=default, metadata={FLAG: FlagSpec(help=help, **spec)})


def not_a_flag(default: Any, *, why: str) -> Any:
    """A config field with no flag of its own (``why``: what sets it instead)."""
    return dataclasses.field(default=default, metadata={NOT_A_FLAG: why})


def int_list(text: str) -> tuple[int, ...]:
    """``19,20,20,21`` -> (19, 20, 20, 21)."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def flag_fields(cls: type) -> list[tuple[Field[Any], FlagSpec]]:
    """The fields of the config class ``cls`` that are flags, in field order."""
    return [(f, f.metadata[FLAG]) for f in dataclasses.fields(cls) if FLAG in f.metadata]


def flag_name(f: Field[Any], spec: FlagSpec) -> str:
    """``--num-layers`` for ``num_layers``; a switch of a field that is on by default is ``--no-<name>``."""
    if spec.name:
        return f"--{spec.name}"
    on_by_default = f.default is True
    return "--" + ("no-" if on_by_default else "") + f.name.replace("_", "-")


def field_default(f: Field[Any]) -> Any:
    """The config's default of field ``f``."""
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None if f.default is MISSING else f.default


def default_text(value: Any) -> str | None:
    """How a default reads in --help and in the flag reference (None: nothing to show)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, tuple):
        return ",".join(map(str, value)) if value else None
    return str(value)


def _without_none(hint: Any) -> Any:
    """``X | None`` -> X."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def _argument_options(cls: type, f: Field[Any], spec: FlagSpec, hint: Any) -> dict[str, Any]:
    """argparse's keywords for field ``f`` of type ``hint``."""
    base = _without_none(hint)
    if base is bool:
        return {"action": "store_false" if f.default is True else "store_true"}
    metavar = spec.metavar or (spec.name.upper().replace("-", "_") if spec.name else None)
    options: dict[str, Any] = {"metavar": metavar}
    if typing.get_origin(base) is Literal:
        options["choices"] = typing.get_args(base)
    elif spec.choices is not None:
        options["choices"] = tuple(spec.choices())
    if spec.nargs is not None:
        items = typing.get_args(base)
        if typing.get_origin(base) is not tuple or items[1:] != (Ellipsis,):
            raise TypeError(f"{cls.__name__}.{f.name}: nargs needs a tuple[X, ...] field, not {hint}")
        base = items[0]
        options["nargs"] = spec.nargs
    if spec.parse is not None:
        options["type"] = spec.parse
    elif base in (int, float):
        options["type"] = base
    elif base is not str and "choices" not in options:
        raise TypeError(f"{cls.__name__}.{f.name}: no text form for {hint}; give parse= in its flag(...)")
    return options


def add_config_flags(group: argparse._ArgumentGroup, cls: type) -> None:
    """One flag per :func:`flag` field of ``cls``, whose absence leaves the field to the config's default."""
    hints = typing.get_type_hints(cls)
    for f, spec in flag_fields(cls):
        shown = default_text(field_default(f))
        group.add_argument(
            flag_name(f, spec),
            dest=f.name,
            default=argparse.SUPPRESS,
            help=(spec.help + (f" (default: {shown})" if shown else "")).replace("%", "%%"),
            **_argument_options(cls, f, spec, hints[f.name]),
        )


def config_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``cls`` whose flags were given, as field values."""
    given = vars(args)
    values = {}
    for f, spec in flag_fields(cls):
        if f.name in given:
            value = given[f.name]
            if spec.convert is not None:
                value = spec.convert(value)
            elif isinstance(value, list):
                value = tuple(value)
            values[f.name] = value
    return values


def parser_flags(parser: argparse.ArgumentParser) -> list[tuple[str | None, list[argparse.Action]]]:
    """(group title, its flags) of ``parser``, in --help order."""
    # argparse keeps its groups and their actions in these attributes (its help formatter reads them) and
    # offers no public accessor
    groups = [(g.title, [a for a in g._group_actions if a.option_strings and a.dest != "help"]) for g in parser._action_groups]  # fmt: skip
    return [(title, actions) for title, actions in groups if actions]


def flag_problems(
    parser: argparse.ArgumentParser, configs: Iterable[type], hand_written: Collection[str]
) -> list[str]:
    """Where fields and flags are not one to one: a field with neither a flag nor a reason (or both), a flag
    field without exactly one flag of SUPPRESS default, a field name in two configs, a flag that is neither a
    field's nor in ``hand_written``, a ``hand_written`` name that no flag has."""
    actions = [a for _, group in parser_flags(parser) for a in group]
    options = {o for a in actions for o in a.option_strings}
    problems: list[str] = []
    owner: dict[str, str] = {}  # field name -> its config class
    flag_dests: set[str] = set()
    for cls in configs:
        for f in dataclasses.fields(cls):
            where = f"{cls.__name__}.{f.name}"
            if (FLAG in f.metadata) == (NOT_A_FLAG in f.metadata):
                problems.append(f"{where}: give it flag(...) or not_a_flag(..., why=...), exactly one")
            if f.name in owner:
                problems.append(f"{where}: also a field of {owner[f.name]} (a flag sets one field)")
            owner[f.name] = cls.__name__
            if FLAG not in f.metadata:
                continue
            flag_dests.add(f.name)
            name = flag_name(f, f.metadata[FLAG])
            mine = [a for a in actions if a.dest == f.name]
            if [a.option_strings for a in mine] != [[name]] or mine[0].default is not argparse.SUPPRESS:
                problems.append(f"{where}: expected one flag {name} with no default of its own, found "
                                f"{[(a.option_strings, a.default) for a in mine]}")  # fmt: skip
    for a in actions:
        if a.dest not in flag_dests and not set(a.option_strings) & set(hand_written):
            problems.append(f"{'/'.join(a.option_strings)}: neither a config field's flag nor hand-written")
    problems += [f"{name}: listed as hand-written, but no flag has it" for name in hand_written if name not in options]  # fmt: skip
    return problems
