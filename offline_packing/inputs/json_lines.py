"""JSON Lines in bounded memory: read line by line, never a whole file, and never more than one record's limit.

`iter_lines` reads a binary stream (a local file, a remote object, a gzip stream being decompressed) one line at
a time with a bounded `readline`: a line longer than `max_record_bytes` is stepped over in 1 MiB pieces and
reported with its length only, so a 500 MB single-line record, or a small gzip that expands to gigabytes,
costs at most one record's limit of memory. Blank lines are not records.

gzip has no random access, so the records of a `.jsonl.gz` are reached by decompressing from the top. A
process keeps one `StreamCursor` per gzip input (`mmpack.offline_packing.inputs.chunks`, in the job context's
caches): the chunks of a file that one worker reads in order continue where the previous one stopped, so each
worker decompresses the file about once.

Truncated or corrupt gzip streams, plain text named `.gz`, and an empty `.gz` (zero bytes, or a stream of
nothing) end the job with one line naming the file (`PackError`): the records after the damage cannot be
counted, so none of the file is silently dropped.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

from mmpack.offline_packing.errors import PackError
from mmpack.offline_packing.inputs.remote import RemoteFiles

_STEP_BYTES = 1 << 20  # an over-long line is stepped over in pieces of this size
_HEAD_BYTES = 64  # what is kept of it: enough to tell a JSON array from a record
_GZIP_BUFFER_BYTES = 1 << 16
_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


@dataclass(frozen=True)
class Line:
    """One non-blank line: its 1-based number, byte offset (in the decompressed stream), length without the
    line end, and its bytes (None when longer than the limit: only its length and first bytes are kept)."""

    number: int
    offset: int
    length: int
    raw: bytes | None
    head: bytes = b""  # the first bytes of a line over the limit


def iter_lines(
    f: IO[bytes], max_record_bytes: int, *, first_line: int = 1, first_offset: int = 0
) -> Iterator[Line]:
    """The non-blank lines of `f` from its current position (line `first_line`, byte `first_offset`)."""
    number, offset = first_line - 1, first_offset
    while raw := f.readline(max_record_bytes + 2):  # + the line end (\r\n)
        number += 1
        start = offset
        offset += len(raw)
        if _content_length(raw) <= max_record_bytes:
            if raw.strip():
                yield Line(number, start, _content_length(raw), raw)
            continue
        head, blank = raw[:_HEAD_BYTES], not raw.strip()
        while not raw.endswith(b"\n") and (raw := f.readline(_STEP_BYTES)):
            offset += len(raw)
            blank = blank and not raw.strip()
        if not blank:
            yield Line(number, start, offset - start - _line_end(raw), None, head)


def _line_end(raw: bytes) -> int:
    return 2 if raw.endswith(b"\r\n") else 1 if raw.endswith(b"\n") else 0


def _content_length(raw: bytes) -> int:
    return len(raw) - _line_end(raw)


class _Opened:
    """`path` (local or a URL) opened for line reads, decompressed on the fly when it ends in `.gz`."""

    def __init__(self, remote: RemoteFiles, path: str) -> None:
        self.raw = remote.open_binary(path)
        self.f: IO[bytes] = self.raw
        if path.endswith(".gz"):
            if not self.raw.read(1):
                self.raw.close()
                raise empty_gzip(path)
            self.raw.seek(0)
            # read through a 64 KiB buffer: GzipFile's own 8 KiB one makes readline twice as slow
            gz = gzip.GzipFile(filename=path, mode="rb", fileobj=self.raw)
            self.f = io.BufferedReader(gz, buffer_size=_GZIP_BUFFER_BYTES)  # type: ignore[arg-type]

    def close(self) -> None:
        self.f.close()  # closes the GzipFile too, which does not close the file under it
        self.raw.close()


@contextmanager
def reading(remote: RemoteFiles, path: str) -> Iterator[IO[bytes]]:
    """`path` opened for line reads inside the block; a damaged gzip stream ends it with `gzip_failure`."""
    opened = _Opened(remote, path)
    try:
        yield opened.f
    except _GZIP_ERRORS as exc:
        raise gzip_failure(path, exc) from None
    finally:
        opened.close()


def gzip_failure(path: str, exc: BaseException) -> PackError:
    """The one-line job error of a damaged gzip input."""
    if isinstance(exc, gzip.BadGzipFile):
        what = "is not a gzip file (plain text named .gz?); rename it without .gz or compress it"
    elif isinstance(exc, EOFError):
        what = "is truncated (its gzip stream ends early); copy or download it again"
    else:
        what = f"is a corrupt gzip file ({exc}); copy or download it again"
    return PackError(f"input {path} {what}")


def empty_gzip(path: str, decompressed: bool = False) -> PackError:
    """The one-line job error of a `.gz` input with nothing in it (a zero-byte file, or a gzip stream of nothing):
    an empty dataset from it would pass unnoticed."""
    what = "decompresses to nothing (0 bytes)" if decompressed else "is empty (0 bytes), not a gzip file"
    return PackError(f"input {path} {what}; remove it from the inputs or write its records into it")


def count_lines(remote: RemoteFiles, path: str, max_record_bytes: int) -> int:
    """The number of records (non-blank lines) of a line-oriented input, read once, in bounded memory; a gzip
    input that decompresses to nothing is an error (`empty_gzip`)."""
    with reading(remote, path) as f:
        count = sum(1 for _ in iter_lines(f, max_record_bytes))
        if path.endswith(".gz") and f.tell() == 0:
            raise empty_gzip(path, decompressed=True)
        return count


class StreamCursor:
    """A gzip input read forward from the top, record by record, remembering where it stopped."""

    def __init__(self, remote: RemoteFiles, path: str, max_record_bytes: int) -> None:
        self.remote, self.path, self.max_record_bytes = remote, path, max_record_bytes
        self._opened: _Opened | None = None
        self._lines: Iterator[Line] = iter(())
        self.next_record = 0

    def records(self, start: int, count: int) -> Iterator[Line]:
        """Records [start, start + count) (0-based), restarting from the top if `start` is behind."""
        if self._opened is None or start < self.next_record:
            self._reopen()
        try:
            while self.next_record < start:
                next(self._lines)
                self.next_record += 1
            for _ in range(count):
                line = next(self._lines)
                self.next_record += 1
                yield line
        except StopIteration:
            raise PackError(
                f"input {self.path} has fewer records than when the job planned it; rerun"
            ) from None
        except _GZIP_ERRORS as exc:
            self._close()
            raise gzip_failure(self.path, exc) from None

    def _reopen(self) -> None:
        self._close()
        self._opened = _Opened(self.remote, self.path)
        self._lines = iter_lines(self._opened.f, self.max_record_bytes)
        self.next_record = 0

    def _close(self) -> None:
        if self._opened is not None:
            self._opened.close()
            self._opened = None
