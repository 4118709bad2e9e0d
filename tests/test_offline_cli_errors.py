"""Every failure of `mmpack pack` ends in one line `mmpack pack: error: ...` naming the file and what to do,
exit code 1 (2 for usage); `--debug` adds the traceback."""

from __future__ import annotations

import builtins
import errno
import json
import os
from pathlib import Path

import pytest

from mmpack.cli import main as mmpack_main
from mmpack.offline_packing.errors import PackError, SampleReject
from mmpack.packing.chat import SampleError
from mmpack.packing.errors import MmpackError
from mmpack.packing.image_tokens import ImageHeaderError, ImageSizeError
from mmpack.packing.tokenizer import BYTE_TOKENIZER


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    rec = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    path.write_text(json.dumps(rec) + "\n")
    return path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str], tokenizer: bool = True) -> tuple[int, str]:
    code = mmpack_main(["pack", *argv, *(["-t", BYTE_TOKENIZER] if tokenizer else []), "--no-progress"])
    return code, capsys.readouterr().err


def _one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("mmpack pack: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_missing_input_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(["-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o"), "-L", "64"], capsys)
    assert code == 1
    assert "nope.jsonl" in _one_error_line(err)


def test_no_tokenizer_is_one_line(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No -t and no --model: one line naming both (and the demo tokenizer's name), nothing written."""
    code, err = _run(["-i", str(data), "-o", str(tmp_path / "o"), "-L", "64"], capsys, tokenizer=False)
    line = _one_error_line(err)
    assert code == 2 and "no tokenizer" in line and "--model" in line and BYTE_TOKENIZER in line
    assert not (tmp_path / "o").exists()
    code, err = _run(["-i", str(data), "-o", str(tmp_path / "o"), "-L", "64"], capsys)  # named: it runs
    assert code == 0 and (tmp_path / "o" / "manifest.json").is_file()


def test_bad_value_is_a_usage_error(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(["-i", str(data), "-o", str(tmp_path / "o"), "-L", "0"], capsys)
    assert code == 2 and "seq_len" in err and "Traceback" not in err


def _deny_writes_under(root: Path, monkeypatch: pytest.MonkeyPatch, error: int) -> None:
    """Simulate a read-only folder or a full disk: opening a file for writing under `root` fails."""
    real_open = builtins.open

    def guarded(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and str(os.fspath(file)).startswith(str(root)):
            raise OSError(error, os.strerror(error), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)


@pytest.mark.parametrize(
    ("error", "advice"),
    [(errno.EACCES, "permission denied"), (errno.EROFS, "read-only"), (errno.ENOSPC, "no space left")],
    ids=["read_only_folder", "read_only_fs", "disk_full"],
)
def test_unwritable_output_is_one_line_naming_the_file(
    data: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    error: int,
    advice: str,
) -> None:
    out = tmp_path / "out"
    _deny_writes_under(out, monkeypatch, error)
    code, err = _run(["-i", str(data), "-o", str(out), "-L", "64"], capsys)
    assert code == 1
    line = _one_error_line(err)
    assert str(out) in line and advice in line and ("-o" in line or "free space" in line)
    assert ".tmp-" not in line  # the file the user knows, not the temporary name it was written under


def test_debug_shows_the_traceback(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    _deny_writes_under(out, monkeypatch, errno.ENOSPC)
    code, err = _run(["-i", str(data), "-o", str(out), "-L", "64", "--debug"], capsys)
    assert (
        code == 1 and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("mmpack pack: error: ")
    )


def test_strict_reject_names_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"conversations": []}\n')
    code, err = _run(["-i", str(path), "-o", str(tmp_path / "o"), "-L", "64", "--strict"], capsys)
    assert code == 1
    assert f"{path}:1: empty_conversation" in _one_error_line(err)


def test_one_error_hierarchy_with_reason() -> None:
    for exc in (
        PackError("x"),
        SampleReject("missing_image", "x"),
        SampleError("malformed_record", "x"),
        ImageHeaderError("x"),
        ImageSizeError("image_too_large", "x"),
    ):
        assert isinstance(exc, MmpackError) and exc.reason and exc.message == "x"
    assert ImageHeaderError("x").reason == "unreadable_image"


def test_errors_cross_process_boundaries_intact() -> None:
    """Worker processes send errors back pickled: every kind keeps its type, reason and message."""
    import pickle

    for exc in (
        PackError("x"),
        SampleReject("missing_image", "x"),
        SampleError("malformed_record", "x"),
        ImageHeaderError("x"),
        ImageSizeError("image_too_large", "x"),
    ):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and back.reason == exc.reason and back.message == "x"
        assert str(back) == str(exc)
