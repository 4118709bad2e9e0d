"""Length files for `mmpack stats`: parse them into per-sample lengths (and image counts, if given).

Accepted forms (local path or fsspec URL):

- text (`.txt`, `.lens`, `.len`, `.lengths`, `.lst`): one sample per line, either `name:len` (OV-style; the
  name may itself hold colons) or a bare integer; blank lines and lines starting with `#` are skipped;
- `.json`: a list of integers, `{"lengths": [...], "image_counts": [...]}`, or a histogram
  `{"max_len": L, "counts": [...]}` where counts[i] is the number of samples of length i + 1;
- `.npy`: a 1-D integer array of lengths, or an [N, 2] array of (length, image count) rows.

Text and `.npy` files are streamed (read in chunks of CHUNK_BYTES): memory holds about 1.5 times the resulting
int64 lengths plus one chunk, never the whole file. `.json` files are parsed whole, so ones over JSON_MAX_BYTES are refused
with a message to use a text or `.npy` length file instead.

Every problem raises `StatsInputError` with a message naming the file (and line where there is one).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import fsspec
import numpy as np

from mmpack.packing.errors import MmpackError

TEXT_SUFFIXES = (".txt", ".lens", ".len", ".lengths", ".lst")
CHUNK_BYTES = 1 << 20
JSON_MAX_BYTES = 64 << 20
LENGTH_FILE_SUFFIXES = (*TEXT_SUFFIXES, ".json", ".npy")


class StatsInputError(MmpackError):
    """Bad input for `mmpack stats`; the message says which file (and line) and what is wrong."""

    default_reason = "bad_input"


class StatsUsageError(StatsInputError):
    """Flags that do not fit together or with the input (exit code 2, as argparse's own errors)."""

    default_reason = "usage"


@dataclass(frozen=True)
class LengthInput:
    """Per-sample lengths read from a length file."""

    path: str
    kind: str  # "lines", "json", "npy" or "histogram"
    lengths: np.ndarray  # int64 [N], every value >= 1
    image_counts: np.ndarray | None = None  # int64 [N] or None when the file has none


def read_length_file(path: str, storage_options: dict[str, Any] | None = None) -> LengthInput:
    """Read a length file of any accepted form; the form follows the file's suffix."""
    suffix = _suffix(path)
    if suffix not in LENGTH_FILE_SUFFIXES:
        raise StatsInputError(
            f"{path}: unknown file type {suffix or '(no suffix)'!r}; expected a packed dataset folder "
            f"(with manifest.json) or a length file ({', '.join(LENGTH_FILE_SUFFIXES)})"
        )
    storage_options = storage_options or {}
    if suffix == ".npy":
        result = _with_file(path, storage_options, lambda f: _parse_npy(path, f))
    elif suffix == ".json":
        result = _with_file(path, storage_options, lambda f: _parse_json(path, _read_json_bytes(path, f)))
    else:
        result = _with_file(path, storage_options, lambda f: _parse_lines(path, f))
    if result.lengths.size == 0:
        raise StatsInputError(f"{path}: no lengths found (empty {result.kind} input)")
    return result


def _suffix(path: str) -> str:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return "." + name.rsplit(".", 1)[-1].lower() if "." in name else ""


def _with_file(
    path: str, storage_options: dict[str, Any], parse: Callable[[Any], LengthInput]
) -> LengthInput:
    try:
        with fsspec.open(path, "rb", **storage_options) as f:
            return parse(f)
    except FileNotFoundError as e:
        raise StatsInputError(f"{path}: no such file") from e
    except IsADirectoryError as e:
        raise StatsInputError(f"{path}: is a folder, not a length file") from e


def _read_json_bytes(path: str, f: Any) -> bytes:
    data = f.read(JSON_MAX_BYTES + 1)
    if len(data) > JSON_MAX_BYTES:
        raise StatsInputError(
            f"{path}: JSON length files are read whole and this one is over {JSON_MAX_BYTES >> 20} MiB; "
            "write the lengths one per line (.txt) or as a .npy array, which are streamed"
        )
    return bytes(data)


def _line_chunks(f: Any) -> Iterator[bytes]:
    """The file in pieces of about CHUNK_BYTES, each ending at a line end (the last one at the file's end)."""
    rest = b""
    while block := f.read(CHUNK_BYTES):
        cut = block.rfind(b"\n")
        if cut < 0:
            rest += block
            continue
        yield rest + block[: cut + 1]
        rest = block[cut + 1 :]
    if rest:
        yield rest


def _parse_lines(path: str, f: Any) -> LengthInput:
    parts: list[np.ndarray] = []
    first_line = 1
    for chunk in _line_chunks(f):
        try:
            text = chunk.decode("utf-8")
        except UnicodeDecodeError as e:
            raise StatsInputError(f"{path}: not UTF-8 text near line {first_line} ({e})") from e
        lines = text.splitlines()
        try:
            # fast path: one int() per line; on any problem, rescan below to name the line
            values = [
                int(line.rpartition(":")[2])
                for line in lines
                if line.strip() and not line.lstrip().startswith("#")
            ]
        except ValueError:
            values = None
        if values is None or (values and min(values) < 1):
            _raise_first_bad_line(path, lines, first_line)
        part = np.asarray(values, dtype=np.int64)
        # held as int32 until the end where lengths allow: the parts then cost half the result
        parts.append(part.astype(np.int32) if part.size and int(part.max()) < 2**31 else part)
        first_line += len(lines)
    return LengthInput(path, "lines", _concatenate(parts))


def _concatenate(parts: list[np.ndarray]) -> np.ndarray:
    """One int64 array of the parts, freeing each part once copied."""
    out = np.empty(sum(p.size for p in parts), dtype=np.int64)
    start = 0
    parts.reverse()
    while parts:
        part = parts.pop()
        out[start : start + part.size] = part
        start += part.size
    return out


def _raise_first_bad_line(path: str, lines: list[str], first_line: int = 1) -> NoReturn:
    for number, line in enumerate(lines, start=first_line):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        field = stripped.rpartition(":")[2].strip()
        try:
            value = int(field)
        except ValueError:
            raise StatsInputError(
                f"{path}:{number}: expected `name:length` or an integer, got {_clip(stripped)!r}"
            ) from None
        _check_length(value, f"{path}:{number}")
    raise AssertionError("a bad line was expected")  # pragma: no cover


def _check_length(value: int, where: str) -> None:
    if value < 1:
        raise StatsInputError(f"{where}: sample length must be a positive integer, got {value}")


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _parse_json(path: str, data: bytes) -> LengthInput:
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StatsInputError(f"{path}: not valid JSON ({e})") from e
    if isinstance(obj, list):
        return LengthInput(path, "json", _int_array(obj, path, "lengths"))
    if isinstance(obj, dict) and "counts" in obj:
        return _parse_histogram(path, obj)
    if isinstance(obj, dict) and "lengths" in obj:
        lengths = _int_array(obj["lengths"], path, "lengths")
        images = None
        if obj.get("image_counts") is not None:
            images = _int_array(obj["image_counts"], path, "image_counts", minimum=0)
            if images.shape != lengths.shape:
                raise StatsInputError(
                    f"{path}: image_counts has {images.size} entries but lengths has {lengths.size}"
                )
        return LengthInput(path, "json", lengths, images)
    raise StatsInputError(
        f"{path}: expected a JSON list of lengths, {{'lengths': [...]}} or a histogram "
        f"{{'max_len': L, 'counts': [...]}}; got {type(obj).__name__}"
        + (f" with keys {sorted(obj)[:6]}" if isinstance(obj, dict) else "")
    )


def _int_array(values: Any, path: str, what: str, minimum: int = 1) -> np.ndarray:
    if not isinstance(values, list):
        raise StatsInputError(f"{path}: {what} must be a list of integers, got {type(values).__name__}")
    if not values:
        return np.zeros(0, dtype=np.int64)
    try:
        array = np.asarray(values)
    except (ValueError, OverflowError):
        array = np.asarray([], dtype=np.float64)
    if array.ndim == 1 and array.dtype.kind == "i" and (array.size == 0 or array.min() >= minimum):
        return array.astype(np.int64, copy=False)  # fast path for long lists
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int):
            raise StatsInputError(f"{path}: {what}[{index}] must be an integer, got {_clip(repr(value))}")
        if value < minimum:
            kind = "a positive" if minimum == 1 else "a non-negative"
            raise StatsInputError(f"{path}: {what}[{index}] must be {kind} integer, got {value}")
    raise StatsInputError(f"{path}: {what} must be a flat list of integers below 2**63")


def _parse_histogram(path: str, obj: dict) -> LengthInput:
    max_len = obj.get("max_len")
    counts = _int_array(obj["counts"], path, "counts", minimum=0)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise StatsInputError(f"{path}: histogram needs a positive integer 'max_len', got {max_len!r}")
    if counts.size != max_len:
        raise StatsInputError(
            f"{path}: histogram 'counts' must have max_len={max_len} entries "
            f"(counts[i] = samples of length i+1), got {counts.size}"
        )
    # pack_lengths takes per-item int64 lengths: expand once, straight into that dtype (16M items: 128 MB)
    lengths = np.repeat(np.arange(1, max_len + 1, dtype=np.int64), counts)
    return LengthInput(path, "histogram", lengths)


def _parse_npy(path: str, f: Any) -> LengthInput:
    try:
        # read_array reads a file object in bounded pieces straight into the result
        array = np.lib.format.read_array(f, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise StatsInputError(f"{path}: not a readable .npy array ({e})") from e
    if not np.issubdtype(array.dtype, np.integer):
        raise StatsInputError(f"{path}: .npy dtype must be an integer type, got {array.dtype}")
    if array.ndim == 2 and array.shape[1] == 2:
        lengths, images = array[:, 0].astype(np.int64), array[:, 1].astype(np.int64)
    elif array.ndim == 1:
        lengths, images = array.astype(np.int64, copy=False), None
    else:
        raise StatsInputError(
            f"{path}: .npy must be 1-D lengths or [N, 2] (length, images), got {array.shape}"
        )
    _check_array(path, lengths, "length", minimum=1)
    if images is not None:
        _check_array(path, images, "image count", minimum=0)
    return LengthInput(path, "npy", lengths, images)


def _check_array(path: str, values: np.ndarray, what: str, minimum: int) -> None:
    bad = np.flatnonzero(values < minimum)
    if bad.size:
        kind = "positive" if minimum == 1 else "non-negative"
        raise StatsInputError(
            f"{path}: {what} at index {bad[0]} must be a {kind} integer, got {values[bad[0]]} "
            f"({bad.size} such entries)"
        )
