"""JSON records as users write them: a `.json` array, a single object, or JSONL content under any of the names
`.json`, `.jsonl`, `.json.gz`, `.jsonl.gz`; with or without a UTF-8 byte-order mark; LF or CRLF line ends.

Each record comes back as a `RawRecord` with its 1-based line. A record that cannot be used is a record with
an error, never a crash and never a silent repair: invalid UTF-8 is `malformed_json` (not replaced by U+FFFD),
a record nested deeper than `MAX_NESTING_DEPTH` is `malformed_record` (the parser's recursion limit is never
reached), a record whose JSON text is longer than `max_record_bytes` is `record_too_large` (never parsed).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

BOM = b"\xef\xbb\xbf"
MAX_NESTING_DEPTH = 100  # real records nest a few levels (record > conversations > message > content parts)
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of bytes that are not UTF-8


@dataclass(frozen=True)
class RawRecord:
    """One record as read: either a parsed object or the error that prevented using it."""

    line: int
    obj: object = None
    error: str | None = None
    tar_sample: object = None  # tar_source.TarSample when the record comes from a WebDataset tar
    error_reason: str = "malformed_json"


def parse_json_line(raw: bytes, line: int) -> RawRecord:
    """One JSONL line (its bytes, newline included or not) as a record."""
    if line == 1:
        raw = raw.removeprefix(BOM)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RawRecord(line, error=f"invalid UTF-8 at byte {exc.start} of the line: {exc.reason}")
    if (too_deep := _depth_error(text)) is not None:
        return RawRecord(line, error=too_deep, error_reason="malformed_record")
    try:
        return RawRecord(line, json.loads(text))
    except ValueError as exc:  # JSONDecodeError, or an integer past the digit limit
        return RawRecord(line, error=f"invalid JSON: {exc}")
    except RecursionError:
        return RawRecord(line, error=_DEEP_MESSAGE, error_reason="malformed_record")


def lone_surrogate(obj: object) -> str | None:
    """The first lone surrogate in the strings of a parsed record, or None: JSON escapes can spell one ("\\ud800"),
    which no file name, tokenizer or UTF-8 output can hold."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        return str(exc.object[exc.start : exc.end])
    return None


def too_large(line: int, size_bytes: int, max_record_bytes: int, tar_sample: object = None) -> RawRecord:
    """The reject of a record of `size_bytes` over the limit (it is not parsed)."""
    return RawRecord(
        line,
        error=f"record of {size_bytes} bytes is larger than --max-record-bytes {max_record_bytes}; split it, or "
        "raise the limit",
        tar_sample=tar_sample,
        error_reason="record_too_large",
    )


def looks_like_json_lines(head: list[bytes], complete: bool = True) -> bool:
    """Whether a `.json` file whose first two non-blank lines are `head` holds JSONL: the first line is a JSON
    value on its own, or it is broken while the second is an object on its own. Otherwise it is one document (an
    array, a pretty-printed object), as `parse_json_document` decides for the whole text. `complete=False`: the
    first line is only its first bytes (it is over the record limit), so only an array shows it a document."""
    if not head:
        return False
    first = head[0].removeprefix(BOM)
    if first.lstrip()[:1] == b"[":
        return False
    if not complete or _parses_alone(first) is not None:
        return True
    return len(head) > 1 and isinstance(_parses_alone(head[1]), dict)


def _parses_alone(raw: bytes | None) -> object:
    try:
        return None if raw is None else json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return None


def parse_json_document(data: bytes, max_record_bytes: int | None = None) -> list[RawRecord]:
    """The records of a whole file's bytes: array elements, one object, or JSONL content (detected)."""
    data = data.removeprefix(BOM)
    text = data.decode("utf-8", errors="surrogateescape")
    pos = skip_ws(text, 0)
    if pos < len(text) and text[pos] == "[":
        return _split_json_array(text, pos, max_record_bytes)
    if pos >= len(text):
        return []
    single = _one_value(text, pos, max_record_bytes)
    if single is not None:
        return [single]
    return parse_json_lines(data, max_record_bytes)


def parse_json_lines(data: bytes, max_record_bytes: int | None = None) -> list[RawRecord]:
    """Every non-blank line of JSONL bytes as a record."""
    return [
        too_large(line, len(raw.rstrip(b"\r")), max_record_bytes)
        if max_record_bytes is not None and len(raw.rstrip(b"\r")) > max_record_bytes
        else parse_json_line(raw, line)
        for line, raw in enumerate(data.split(b"\n"), start=1)
        if raw.strip()
    ]


_DEEP_MESSAGE = f"record is nested deeper than {MAX_NESTING_DEPTH} levels"


def _one_value(text: str, pos: int, max_record_bytes: int | None = None) -> RawRecord | None:
    """The file as one JSON value (one record), or None when it holds JSONL content.

    JSONL: a first value followed by more, or a first value that fails to parse while a later line on its
    own is a JSON object (a broken first line, not one broken pretty-printed object).
    """
    line = text.count("\n", 0, pos) + 1
    try:
        _, end = json.JSONDecoder().raw_decode(text, pos)
    except ValueError as exc:  # JSONDecodeError, or an integer past the digit limit
        if _later_line_is_object(text, pos):
            return None
        return RawRecord(line, error=f"invalid JSON: {exc}")
    except RecursionError:
        end = value_end(text, pos)
    if skip_ws(text, end) < len(text):
        return None
    return parse_element(text, pos, end, line, max_record_bytes)


def _later_line_is_object(text: str, pos: int) -> bool:
    """True when the first non-blank line after the one at `pos` is, on its own, a JSON object."""
    start = text.find("\n", pos)
    while start >= 0:
        end = text.find("\n", start + 1)
        candidate = text[start + 1 : end if end >= 0 else len(text)]
        if candidate.strip():
            try:
                return isinstance(json.loads(candidate), dict)
            except (ValueError, RecursionError):
                return False
        start = end
    return False


def _split_json_array(text: str, pos: int, max_record_bytes: int | None = None) -> list[RawRecord]:
    """Elements of a top-level JSON array with the line each starts on."""
    decoder = json.JSONDecoder()
    records: list[RawRecord] = []
    pos = skip_ws(text, pos + 1)
    line, counted_to = 1, 0
    while pos < len(text) and text[pos] != "]":
        line += text.count("\n", counted_to, pos)
        counted_to = pos
        try:
            _, end = decoder.raw_decode(text, pos)
        except ValueError as exc:  # JSONDecodeError, or an integer past the digit limit
            # the rest of the array cannot be split reliably: one reject for it
            records.append(RawRecord(line, error=f"{malformed_element(len(records))}: {exc}"))
            return records
        except RecursionError:
            end = value_end(text, pos)
        records.append(parse_element(text, pos, end, line, max_record_bytes))
        pos = skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = skip_ws(text, pos + 1)
    return records


def malformed_element(index: int) -> str:
    """The start of the message of an array element that is not valid JSON (the last record of its file)."""
    return f"invalid JSON at array index {index} (the rest of the array is not read)"


def parse_element(
    text: str, start: int, end: int, line: int, max_record_bytes: int | None = None
) -> RawRecord:
    """The array element `text[start:end]` (decoded with surrogateescape), starting on `line`, as a record."""
    piece = text[start:end]
    if max_record_bytes is not None and 4 * len(piece) > max_record_bytes:  # else it fits, in any encoding
        size = len(piece.encode("utf-8", "surrogateescape"))
        if size > max_record_bytes:
            return too_large(line, size, max_record_bytes)
    if (bad := _ESCAPED_BYTE.search(piece)) is not None:
        at = line + piece.count("\n", 0, bad.start())
        return RawRecord(line, error=f"invalid UTF-8 (byte 0x{ord(bad.group()) - 0xDC00:02x} on line {at})")
    if (too_deep := _depth_error(piece)) is not None:
        return RawRecord(line, error=too_deep, error_reason="malformed_record")
    try:
        return RawRecord(line, json.loads(piece))
    except ValueError as exc:  # JSONDecodeError, or an integer past the digit limit
        return RawRecord(line, error=f"invalid JSON: {exc}")
    except RecursionError:
        return RawRecord(line, error=_DEEP_MESSAGE, error_reason="malformed_record")


def _depth_error(text: str) -> str | None:
    """A message if `text` nests deeper than MAX_NESTING_DEPTH (cheap unless it holds many brackets)."""
    if text.count("[") + text.count("{") <= MAX_NESTING_DEPTH:
        return None
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_NESTING_DEPTH:
                return _DEEP_MESSAGE
        elif ch in "]}":
            depth -= 1
    return None


def value_end(text: str, pos: int) -> int:
    """Index just past the JSON value starting at `pos`, found without parsing it (strings and brackets only).

    For a value that is not a bracketed one, the end of its line. Used to step over a value the parser
    refuses as too deep.
    """
    if text[pos] not in "[{":
        newline = text.find("\n", pos)
        return len(text) if newline < 0 else newline
    depth = 0
    in_string = escaped = False
    for i in range(pos, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def skip_ws(text: str, pos: int) -> int:
    """The first index at or after `pos` that is not JSON whitespace (len(text) if none)."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos
