"""A JSON document that is a top-level list, read element by element: never held whole.

`ArrayReader` decodes the file through a sliding window (1 MiB blocks, grown to the element being read) and splits
it as `json_records.parse_json_document` splits a whole array (`json.JSONDecoder.raw_decode` from each element's
start): the same records, lines and messages, a malformed element's position counted from the top of the file.
The chunk planner reads a file once to count its elements and note where each chunk starts (`ArrayPosition`);
each chunk then reads its own elements from there. Memory: the window, so a few MiB plus the largest element
(after a malformed element, the rest of the file: it cannot be split reliably past one).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from mmpack.offline_packing.inputs.json_records import (
    BOM,
    RawRecord,
    malformed_element,
    parse_element,
    skip_ws,
    value_end,
)

BLOCK_BYTES = 1 << 20
_NUMBER_START = "-0123456789"
_NUMBER_CHARS = "0123456789.eE+-"


@dataclass(frozen=True)
class ArrayPosition:
    """Where an element starts: its byte offset in the file, its 1-based line, its index in the array, and (for
    the position a malformed element's message gives) its character offset in the text after a BOM and its
    0-based column."""

    byte_offset: int
    line: int
    index: int = 0
    char_offset: int = 0
    column: int = 0


class ArrayReader:
    """The elements of a top-level JSON array in the binary file `f`, from the element at `at`."""

    def __init__(
        self, f: IO[bytes], at: ArrayPosition, max_record_bytes: int | None, block_bytes: int = BLOCK_BYTES
    ) -> None:
        f.seek(at.byte_offset)
        self._f, self._max_record_bytes, self._block_bytes = f, max_record_bytes, block_bytes
        self._decode = codecs.getincrementaldecoder("utf-8")("surrogateescape").decode
        self._decoder = json.JSONDecoder()
        self._buf, self._pos, self._eof = "", 0, False
        # what the window has dropped: bytes, characters, characters since the last line end
        self._byte_base, self._char_base, self._column_base = at.byte_offset, at.char_offset, at.column
        self._line, self._counted = at.line, 0  # the line of `_buf[_counted]`
        self._index = at.index

    def position(self) -> ArrayPosition:
        """Where the reader stands: between two elements, the start of the next one."""
        newline = self._buf.rfind("\n", 0, self._pos)
        return ArrayPosition(
            byte_offset=self._byte_base + len(self._buf[: self._pos].encode("utf-8", "surrogateescape")),
            line=self._line + self._buf.count("\n", self._counted, self._pos),
            index=self._index,
            char_offset=self._char_base + self._pos,
            column=self._pos - newline - 1 if newline >= 0 else self._column_base + self._pos,
        )

    def records(self, *, parse: bool = True) -> Iterator[RawRecord | None]:
        """The elements up to the closing "]" (or the end of the file), each as a record; an element that is not
        valid JSON is the last (a reject). `parse=False`: None for each valid one (counting them)."""
        while self._skip_ws() and self._buf[self._pos] != "]":
            self._line += self._buf.count("\n", self._counted, self._pos)
            self._counted = self._pos
            end, failure = self._element_end()
            if failure is not None:
                yield RawRecord(
                    self._line, error=f"{malformed_element(self._index)}: {self._message(failure)}"
                )
                return
            start, self._pos = self._pos, end
            record = (
                parse_element(self._buf, start, end, self._line, self._max_record_bytes) if parse else None
            )
            if self._skip_ws() and self._buf[self._pos] == ",":
                self._pos += 1
                self._skip_ws()
            self._index += 1
            yield record

    def _element_end(self) -> tuple[int, ValueError | None]:
        """The end of the element at `_pos`, or why it is not valid JSON; the window grows until it holds it."""
        while True:
            failure: ValueError | None = None
            try:
                _, end = self._decoder.raw_decode(self._buf, self._pos)
            except ValueError as exc:  # JSONDecodeError, or an integer past the digit limit
                end, failure = len(self._buf), exc
            except RecursionError:  # too deep for the parser: a reject of parse_element, stepped over here
                end = value_end(self._buf, self._pos)
            # an element cut by the window's end may fail, or end early (a number cut after "1" of "1e+16"): read
            # on, then decide
            if not self._may_be_cut(end) or not self._fill():
                return end, failure

    def _may_be_cut(self, end: int) -> bool:
        if self._buf[self._pos] in _NUMBER_START:
            return not self._buf[end:].strip(_NUMBER_CHARS)  # nothing after it but what could continue it
        return end >= len(self._buf)

    def _message(self, failure: ValueError) -> str:
        """The parser's message, its position counted from the top of the file as for the whole text."""
        if not isinstance(failure, json.JSONDecodeError):
            return str(failure)
        at = failure.pos
        newline = self._buf.rfind("\n", 0, at)
        line = self._line + self._buf.count("\n", self._counted, at)
        column = at - newline if newline >= 0 else self._column_base + at + 1
        return f"{failure.msg}: line {line} column {column} (char {self._char_base + at})"

    def _skip_ws(self) -> bool:
        """Moves past whitespace; False at the end of the file."""
        while True:
            self._pos = skip_ws(self._buf, self._pos)
            if self._pos < len(self._buf):
                return True
            if not self._fill():
                return False

    def _fill(self) -> bool:
        """Drops the window before `_pos` and reads on (at least as much as it keeps, so an element read again
        after a fill costs at most twice its size); False at the end of the file."""
        if self._eof:
            return False
        dropped = self._buf[: self._pos]
        self._line += dropped.count("\n", self._counted)
        self._byte_base += len(dropped.encode("utf-8", "surrogateescape"))
        self._char_base += len(dropped)
        newline = dropped.rfind("\n")
        self._column_base = len(dropped) - newline - 1 if newline >= 0 else self._column_base + len(dropped)
        self._buf, self._pos, self._counted = self._buf[self._pos :], 0, 0
        data = self._f.read(max(self._block_bytes, len(self._buf)))
        self._eof = not data
        self._buf += self._decode(data, final=self._eof)
        return True


def open_array(
    f: IO[bytes], max_record_bytes: int | None, block_bytes: int = BLOCK_BYTES
) -> ArrayReader | None:
    """A reader at the first element of the array that `f` holds (after a BOM and whitespace), or None when its
    text does not start with "[" (another kind of document)."""
    f.seek(0)
    start = len(BOM) if f.read(len(BOM)) == BOM else 0
    reader = ArrayReader(f, ArrayPosition(start, 1), max_record_bytes, block_bytes)
    if not reader._skip_ws() or reader._buf[reader._pos] != "[":
        return None
    reader._pos += 1
    return reader


def chunk_starts(
    f: IO[bytes], chunk_size: int, max_record_bytes: int | None, block_bytes: int = BLOCK_BYTES
) -> tuple[list[ArrayPosition], int]:
    """Where every `chunk_size`-th element of the array `f` holds starts, and how many records it has (a first
    pass: the elements are checked as far as splitting needs, not parsed into records)."""
    reader = open_array(f, max_record_bytes, block_bytes)
    if reader is None:
        raise ValueError("not a JSON array")
    starts, count = [reader.position()], 0
    for _ in reader.records(parse=False):
        count += 1
        if count % chunk_size == 0:
            starts.append(reader.position())
    return starts[: -(-count // chunk_size)], count
