"""Mixture specs and --split are input with limits: a YAML alias bomb (as a source or under storage_options) is
refused at once without printing the expanded entry; weights are finite numbers in a sane range (1e308, nan,
`true` refused) and the blend of the largest allowed ones is served; unknown top-level keys, FIFOs, devices and
oversized files are refused naming the file; a missing dataset is one line naming its path; `--split nan,1,1`
names the flag and `--split 1e308,1e308,1` is refused. Hypothesis: any spec gives a mixture or one line."""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmpack.dataloader.blend import blend_positions, normalised_weights
from mmpack.dataloader.manifest import DatasetNotFoundError, load_manifest
from mmpack.dataloader.mixture import (
    MAX_MIXTURE_FILE_BYTES,
    WEIGHT_RANGE,
    Mixture,
    MixtureSource,
    load_mixture_file,
    parse_inline,
)
from mmpack.trainer.config import split_weights
from tests.support.timeouts import deadline

# ten anchors, each a list of nine aliases of the one before: 10 x 9^9 (3.9e9) scalars once expanded
BOMB = "\n".join(
    ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
)


def _spec(tmp_path: Path, text: str, name: str = "mix.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _refused(path: str, match: str) -> str:
    started = time.monotonic()
    with deadline(30), pytest.raises(ValueError, match=match) as info:
        load_mixture_file(path)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400 and path in message, message
    assert time.monotonic() - started < 5
    return message


def test_alias_bombs_are_refused_without_expanding_them(tmp_path: Path) -> None:
    """As a source (the old message printed the expanded entry: minutes and gigabytes), under storage_options,
    and an alias inside its own anchor."""
    anchors = [line.split(": ", 1)[1] for line in BOMB.splitlines()]
    as_source = "sources:\n  - [" + ", ".join(anchors) + "]\n"
    _refused(_spec(tmp_path, as_source, "source.yaml"), "aliases expand past")
    nested = "{" + ", ".join(f"k{i}: {a}" for i, a in enumerate(anchors)) + "}"
    under_options = f"sources:\n  - {{path: /d/a, weight: 1, storage_options: {nested}}}\n"
    _refused(_spec(tmp_path, under_options, "options.yaml"), "aliases expand past")
    loop = "sources:\n  - &s {path: /d/a, weight: 1, storage_options: {again: *s}}\n"
    _refused(_spec(tmp_path, loop, "loop.yaml"), "refers to a node it is inside")


def test_a_small_alias_is_still_read(tmp_path: Path) -> None:
    """Control: an alias sharing one storage_options mapping between two sources is what aliases are for."""
    text = (
        "sources:\n  - {path: /d/a, weight: 1, storage_options: &s3 {anon: true}}\n"
        "  - {path: /d/b, weight: 2, storage_options: *s3}\n"
    )
    mixture = load_mixture_file(_spec(tmp_path, text))
    assert [s.storage_options for s in mixture.sources] == [{"anon": True}, {"anon": True}]


@pytest.mark.parametrize(
    ("weight", "match"),
    [("1.0e308", "weight must be a positive number"), (".nan", "got nan"), ("-.inf", "got -inf"), ("0", "got 0"),
     ("true", "got True"), ("'0.5'", "got '0.5'"), ("1e-3", "YAML reads 1e-3 as text")],
)  # fmt: skip
def test_weights_outside_the_range_are_refused(tmp_path: Path, weight: str, match: str) -> None:
    text = f"sources:\n  - {{path: /d/a, weight: {weight}}}\n  - {{path: /d/b, weight: 1}}\n"
    _refused(_spec(tmp_path, text), match)


def test_inline_weights_outside_the_range_are_refused() -> None:
    for words in (["1e308", "/d/a", "1e308", "/d/b"], ["nan", "/d/a", "1", "/d/b"], ["inf", "/d/a"]):
        with pytest.raises(ValueError, match="weight must be a positive number from 1e-09 to 1e\\+12"):
            parse_inline(words)
    low, high = WEIGHT_RANGE  # control: the ends of the range are weights
    assert [s.weight for s in parse_inline([str(high), "/d/a", str(low), "/d/b"]).sources] == [high, low]


def test_blend_of_extreme_weights_ends_and_is_shared_fairly() -> None:
    """`blend_positions` looped for ever on weights whose sum overflows; the largest allowed weights (and the
    blend's own inputs up to 1e308) give their shares."""
    with deadline(20):
        src, _ = blend_positions([1e308, 1e308], seed=0, start=0, count=1000)
    assert abs(int((src == 0).sum()) - 500) <= 2
    mixture = Mixture(
        sources=(MixtureSource(path="/d/a", weight=1e12), MixtureSource(path="/d/b", weight=3e11))
    )
    assert mixture.shares([10, 10]) == pytest.approx((1 / 1.3, 0.3 / 1.3))
    with pytest.raises(ValueError, match="too wide a range"):
        normalised_weights([1e308, 1e-300])


def test_unknown_keys_are_refused_naming_them(tmp_path: Path) -> None:
    text = "sources:\n  - {path: /d/a, weight: 1}\nsource_weights: [1]\n"
    _refused(_spec(tmp_path, text), r"unknown top-level key\(s\) \['source_weights'\]")
    text = "sources:\n  - {path: /d/a, weight: 1, wieght: 2}\n"
    _refused(_spec(tmp_path, text), r"source 0 must be a mapping of .*; unknown key\(s\) \['wieght'\]")
    control = _spec(tmp_path, "sources:\n  - {path: /d/a, weight: 1}\n")
    assert load_mixture_file(control).names == ("a",)


def test_fifo_device_folder_and_oversized_files_are_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "mix.yaml"
    os.mkfifo(fifo)  # no writer: reading it would block for ever
    _refused(str(fifo), "is a FIFO; give a YAML or JSON file")
    _refused("/dev/zero", "is a character device")
    _refused(str(tmp_path), "is a folder")
    big = _spec(tmp_path, "# " + "x" * MAX_MIXTURE_FILE_BYTES + "\n", "big.yaml")
    _refused(big, f"larger than the limit of {MAX_MIXTURE_FILE_BYTES} bytes")
    _refused(str(tmp_path / "missing.yaml"), "cannot read mixture file .*No such file")


def test_trainer_refuses_a_fifo_mixture_and_bad_splits_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mmpack.trainer.arguments import parse_args

    fifo = tmp_path / "mix.yaml"
    os.mkfifo(fifo)
    with deadline(30), pytest.raises(ValueError, match="is a FIFO"):
        parse_args(["--data-mixture", str(fifo)])
    for split in ("nan,1,1", "1e308,1e308,1", "inf", "2,-1", "0,0,0"):
        with pytest.raises(SystemExit):
            parse_args(["--mock-data", "--split", split])
        err = capsys.readouterr().err
        assert f"argument --split: --split takes up to three weights from 0 to 1e+12, not all 0 (e.g. 969,30,1), got '{split}'" in err  # fmt: skip
    assert split_weights("98/1/1") == (98.0, 1.0, 1.0)  # control


def test_missing_dataset_is_one_line_naming_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--data-path nope` and a missing source of a weighted list: one line from the trainer's entry point (the
    refusal comes before any process group), a DatasetNotFoundError (still a FileNotFoundError) from the loader."""
    from mmpack.trainer.pretrain_vlm import main

    nope = tmp_path / "nope"
    with pytest.raises(DatasetNotFoundError, match=f"no packed dataset at '{nope}'") as info:
        load_manifest(str(nope))
    assert isinstance(info.value, FileNotFoundError)
    for data_path in ([str(nope)], ["1", str(nope), "1", str(tmp_path / "other")]):
        code = main(["--data-path", *data_path, "--seq-length", "64"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith(f"pretrain_vlm: error: no packed dataset at '{nope}'"), err


def test_trainer_refuses_overflowing_weights_before_building_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--data-path 1e308 A 1e308 B` built the model, then a loader worker died; now one line from the entry
    point, before any dataset is read. Control: the largest allowed weights pass on to the datasets' check."""
    from mmpack.trainer.pretrain_vlm import main

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for weight, line in (("1e308", f"mixture source '{a}': weight must be a positive number"),
                         (str(WEIGHT_RANGE[1]), f"no packed dataset at '{a}'")):  # fmt: skip
        code = main(["--data-path", weight, a, weight, b, "--seq-length", "64"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(f"pretrain_vlm: error: {line}"), err


def test_stats_of_a_mixture_with_overflowing_weights_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`mmpack stats --mixture` printed shares of 0 and nan for weights of 1e308; the spec is refused first."""
    from mmpack.cli import main as mmpack_main

    code = mmpack_main(["stats", "--mixture", "1e308 /d/a 1e308 /d/b"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "weight must be a positive number" in err[0], err


# hypothesis: specs built from the keys and values a mixture takes, and some it does not
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10**13), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.sampled_from(["/d/a", "/d/b", "s3://b/c", ""]),
)  # fmt: skip
KEYS = st.sampled_from(["path", "weight", "repeat", "name", "storage_options", "sources", "other"])
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4), max_leaves=12)  # fmt: skip


def _one_line(exc: ValueError) -> None:
    assert "\n" not in str(exc) and str(exc)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.dictionaries(KEYS, VALUES, max_size=3) | VALUES, as_json=st.booleans())
def test_any_spec_file_gives_a_mixture_or_one_line(tmp_path: Path, spec: object, as_json: bool) -> None:
    import yaml

    text = json.dumps(spec) if as_json else yaml.safe_dump(spec)
    try:
        mixture = load_mixture_file(_spec(tmp_path, text, "any.json" if as_json else "any.yaml"))
    except ValueError as exc:
        _one_line(exc)
        return
    for s in mixture.sources:
        value = s.weight if s.weight is not None else s.repeat
        assert isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="sourcepathweight:-{}[],&*!| \n\t\x070123456789.e'\"", max_size=80))
def test_any_yaml_text_gives_a_mixture_or_one_line(tmp_path: Path, text: str) -> None:
    try:
        load_mixture_file(_spec(tmp_path, text))
    except ValueError as exc:
        _one_line(exc)


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.one_of(st.text(max_size=6), st.sampled_from(["nan", "inf", "1e308", "-1", "0.5", "/d/a"])), max_size=6))  # fmt: skip
def test_any_inline_spec_gives_a_mixture_or_one_line(words: list[str]) -> None:
    try:
        mixture = parse_inline(words)
    except ValueError as exc:
        _one_line(exc)
        return
    assert all(WEIGHT_RANGE[0] <= (s.weight or 0) <= WEIGHT_RANGE[1] for s in mixture.sources)


@settings(max_examples=80, deadline=None)
@given(text=st.one_of(st.text(max_size=20), st.lists(st.sampled_from(["nan", "inf", "1e308", "-0", "0", "1", "969", "1e12", "1.5", ""]), max_size=4).map(",".join)))  # fmt: skip
def test_any_split_gives_three_weights_or_one_line_naming_the_flag(text: str) -> None:
    try:
        weights = split_weights(text)
    except argparse.ArgumentTypeError as exc:
        assert str(exc).startswith("--split takes") and "\n" not in str(exc)
        return
    assert (
        len(weights) == 3 and all(math.isfinite(w) and 0 <= w <= 1e12 for w in weights) and sum(weights) > 0
    )
