"""The trainer's flags come from their config fields (mmpack.trainer.flags): fields and flags one to one, the
config's default the only default, the type's choices, and docs/trainer-flags.md written from the same source.
Each check has a control that fails it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from mmpack.trainer.arguments import HAND_WRITTEN_FLAGS, build_parser, parse_args, section_configs
from mmpack.trainer.config import DataConfig, RunConfig
from mmpack.trainer.flag_reference import main as reference_main
from mmpack.trainer.flag_reference import render_reference
from mmpack.trainer.flags import add_config_flags, config_values, flag, flag_problems, int_list, not_a_flag

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "trainer-flags.md"


@dataclass(kw_only=True, frozen=True)
class Planted:
    """A config of every kind of flag field."""

    size: int = flag(3, help="a size")
    style: Literal["a", "b"] = flag("a", help="a style")
    fused: bool = flag(True, help="turn off the fusion")
    layers: tuple[int, ...] | None = flag(None, help="per stage", parse=int_list, metavar="N0,N1")
    ids: tuple[int, ...] = flag((), help="some ids", nargs="*")
    renamed: str | None = flag(None, help="renamed", name="other-name")
    derived: int = not_a_flag(0, why="set from the others")


def _parser(*classes: type) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    for cls in classes:
        add_config_flags(p.add_argument_group(cls.__name__), cls)
    return p


def _configs() -> list[type]:
    return [cls for _, _, cls in section_configs()]


def test_fields_and_flags_are_one_to_one() -> None:
    assert flag_problems(build_parser(), _configs(), HAND_WRITTEN_FLAGS) == []


def test_control_one_to_one_finds_each_kind_of_mismatch() -> None:
    @dataclass(kw_only=True, frozen=True)
    class Unmarked:
        seed: int = 1  # a field with neither flag(...) nor not_a_flag(...)

    assert flag_problems(_parser(Planted), [Planted], ()) == []  # control of the controls: it passes
    found = flag_problems(_parser(Planted), [Planted, Unmarked], ())
    assert found == ["Unmarked.seed: give it flag(...) or not_a_flag(..., why=...), exactly one"]

    @dataclass(kw_only=True, frozen=True)
    class Unparsed:
        lr: float = flag(1.0, help="a rate")  # a flag field the parser does not have

    assert flag_problems(_parser(Planted), [Planted, Unparsed], ())[0].startswith(
        "Unparsed.lr: expected one flag --lr"
    )
    extra = _parser(Planted)
    extra.add_argument("--stray", default=None)
    assert flag_problems(extra, [Planted], ()) == ["--stray: neither a config field's flag nor hand-written"]
    assert flag_problems(extra, [Planted], ("--stray",)) == []
    assert flag_problems(_parser(Planted), [Planted], ("--gone",)) == ["--gone: listed as hand-written, but no flag has it"]  # fmt: skip
    own_default = _parser(Planted)
    own_default.set_defaults(size=3)  # argparse's own default beside the config's: written twice
    assert flag_problems(own_default, [Planted], ()) == [
        "Planted.size: expected one flag --size with no default of its own, found [(['--size'], 3)]"
    ]
    own_default.add_argument("--size-again", dest="size", type=int)  # a second flag of the field
    assert flag_problems(own_default, [Planted], ())[0].startswith("Planted.size: expected one flag --size")


def test_flag_forms_derived_from_the_field_types() -> None:
    p = _parser(Planted)
    given = p.parse_args(["--size", "5", "--style", "b", "--no-fused", "--layers", "1,2", "--ids", "4", "6"])
    assert config_values(Planted, given) == {"size": 5, "style": "b", "fused": False, "layers": (1, 2), "ids": (4, 6)}  # fmt: skip
    assert config_values(Planted, p.parse_args(["--other-name", "x"])) == {"renamed": "x"}
    assert config_values(Planted, p.parse_args([])) == {}  # nothing given: the config's defaults stay
    with pytest.raises(SystemExit):
        p.parse_args(["--style", "c"])  # choices from the Literal
    help_text = p.format_help()
    assert "(default: 3)" in help_text and "(default: a)" in help_text and "--derived" not in help_text

    @dataclass(kw_only=True, frozen=True)
    class NoTextForm:
        weights: tuple[float, float] = flag((1.0, 2.0), help="two weights")  # neither parse= nor nargs

    with pytest.raises(TypeError, match=r"NoTextForm.weights: no text form .*give parse="):
        _parser(NoTextForm)


def test_absent_flags_leave_the_configs_defaults() -> None:
    """No defaults of argparse's own: parsing only --mock-data gives the configs' defaults exactly."""
    assert parse_args(["--mock-data"]) == RunConfig(data=DataConfig(mock_data=True))
    assert parse_args(["--mock-data", "--lr", "0.5"]) != RunConfig(data=DataConfig(mock_data=True))  # control
    args = build_parser().parse_args(["--mock-data"])
    assert set(vars(args)) == {"mock_data", *(f.lstrip("-").replace("-", "_") for f in HAND_WRITTEN_FLAGS)}


def test_flag_reference_is_current(tmp_path: Path) -> None:
    assert REFERENCE.read_text() == render_reference(), (
        "docs/trainer-flags.md is stale: run `python -m mmpack.trainer.flag_reference docs/trainer-flags.md`"
    )
    # --check passes the fresh file and fails a stale one (control)
    fresh, stale = tmp_path / "fresh.md", tmp_path / "stale.md"
    assert reference_main([str(fresh)]) == 0 and fresh.read_text() == render_reference()
    stale.write_text(render_reference().replace("| peak learning rate |", "| the learning rate |"))
    assert stale.read_text() != fresh.read_text()
    assert reference_main([str(fresh), "--check"]) == 0
    assert reference_main([str(stale), "--check"]) == 1
    # rows carry the config's default, the field, the choices from the type and the hand-written ones
    text = fresh.read_text()
    assert "| `--num-workers` | int | `2` | `data.num_workers` | loader worker processes |" in text
    assert "| `--cp-comm-type` | `p2p` \\| `a2a` \\| `all_gather` | `p2p` | `parallel.cp_comm_type` |" in text
    assert "| `--data-parallel-size` | int | — | `parallel.expected_data_parallel_size` |" in text
    assert "| `--model-size` | `small` \\| `tiny` | — | hand-written |" in text
