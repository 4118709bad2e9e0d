"""Plain JSON arrays read element by element (`offline_packing/inputs/json_array.py`): whatever the window and
chunk sizes, the records, lines and messages are those of the whole text split at once
(`json_records.parse_json_document`, the reader of gzip documents); an array packs as the same records written as
JSON Lines; a malformed element is a reject naming its index, the last record of its file."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpack.offline_packing.context import JobContext
from mmpack.offline_packing.inputs.json_array import ArrayReader, chunk_starts, open_array
from mmpack.offline_packing.inputs.json_records import BOM, RawRecord, parse_json_document
from tests.support.fixtures_data import dataset_files

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
elements = st.one_of(
    json_values.map(json.dumps),
    json_values.map(lambda v: json.dumps(v, ensure_ascii=False, indent=1)),  # non-ASCII, over several lines
    st.sampled_from(
        [
            '{"a": 1',  # cut
            '{"a" 1}',
            '"open',
            "tru",
            "12e",
            '{"s": "\\ud800"}',  # a lone surrogate escape: valid JSON
            "1" * 5000,  # past the integer digit limit: a ValueError that is no JSONDecodeError
            "[" * 1200 + "]" * 1200,  # too deep for the parser
            '{"a": 1}}',
        ]
    ),
)
separators = st.sampled_from([",", ", ", ",\n", "\r\n,\r\n", "\n", " ", ""])  # "" and " ": a comma missing


@st.composite
def arrays(draw: st.DrawFn) -> bytes:
    """The bytes of a JSON array as users (and broken tools) write them."""
    items = draw(st.lists(elements, max_size=6))
    seps = draw(st.lists(separators, min_size=len(items), max_size=len(items)))
    body = "".join(item + sep for item, sep in zip(items, seps))
    text = draw(st.sampled_from(["", "  \n", "\r\n"])) + "[" + draw(st.sampled_from(["", "\n", " "])) + body
    text += draw(st.sampled_from(["]", "\n]\n", "", "] trailing", "]\n[1]"]))
    data = text.encode("utf-8", "surrogatepass")
    if draw(st.booleans()):
        data = BOM + data
    if draw(st.integers(0, 3)) == 0:  # bytes that are not UTF-8, anywhere after the "["
        at = draw(st.integers(data.index(b"[") + 1, len(data)))
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xe2\x82"])) + data[at:]
    return data


def _key(records: list[RawRecord]) -> list[tuple]:
    return [(r.line, r.obj, r.error, r.error_reason) for r in records]


def _streamed(
    data: bytes, chunk_size: int, max_record_bytes: int | None, block_bytes: int
) -> list[RawRecord]:
    """The records of `data` as the planner cuts and the chunks read them (each chunk reading afresh)."""
    starts, count = chunk_starts(io.BytesIO(data), chunk_size, max_record_bytes, block_bytes)
    records: list[RawRecord] = []
    for i, at in enumerate(starts):
        reader = ArrayReader(io.BytesIO(data), at, max_record_bytes, block_bytes)
        for _, record in zip(range(min(chunk_size, count - i * chunk_size)), reader.records()):
            assert record is not None
            records.append(record)
    assert len(records) == count
    return records


@settings(max_examples=300, deadline=None)
@given(
    data=arrays(),
    chunk_size=st.integers(1, 4),
    max_record_bytes=st.sampled_from([None, 24, 1 << 20]),
    block_bytes=st.integers(1, 48),
)
def test_an_array_read_by_chunks_is_the_array_read_whole(
    data: bytes, chunk_size: int, max_record_bytes: int | None, block_bytes: int
) -> None:
    assert open_array(io.BytesIO(data), max_record_bytes, block_bytes) is not None
    expected = parse_json_document(data, max_record_bytes)
    assert _key(_streamed(data, chunk_size, max_record_bytes, block_bytes)) == _key(expected)


# Runs of line ends and one line spread over several windows of 4 bytes, a non-ASCII element, a malformed one
# at the end.
CONTROL = '[\n{"a": 1},\n\n\n\n\n\n {"b": "é"},\n {"c": 3}, {"d": 4}, {"e" 5}]'.encode()


@pytest.mark.parametrize("forgotten", ["_line", "_byte_base", "_column_base", "_char_base"])
def test_control_a_window_that_forgets_what_it_dropped_is_found(
    forgotten: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: a reader whose window forgets one count of what it drops (lines, bytes, columns, characters)
    differs from the whole read; the right one does not."""
    expected = _key(parse_json_document(CONTROL))
    assert _key(_streamed(CONTROL, 2, None, 4)) == expected
    fill = ArrayReader._fill

    def forgetful(self: ArrayReader) -> bool:
        kept = getattr(self, forgotten)
        filled = fill(self)
        setattr(self, forgotten, kept)
        return filled

    monkeypatch.setattr(ArrayReader, "_fill", forgetful)
    assert _key(_streamed(CONTROL, 2, None, 4)) != expected


def test_control_a_chunk_that_does_not_know_its_first_index_is_found() -> None:
    """Control: the last chunk's reader started at index 0 names the malformed element's index wrongly."""
    starts, _ = chunk_starts(io.BytesIO(CONTROL), 2, None, 4)
    [right] = ArrayReader(io.BytesIO(CONTROL), starts[-1], None, 4).records()
    [wrong] = ArrayReader(io.BytesIO(CONTROL), replace(starts[-1], index=0), None, 4).records()
    assert right is not None and wrong is not None
    assert right.error == parse_json_document(CONTROL)[-1].error != wrong.error
    assert right.error is not None and "at array index 4 " in right.error


def _record(i: int) -> dict:
    chat = [{"from": "human", "value": f"question {i}, é?"}, {"from": "gpt", "value": f"answer {i}"}]
    return {"id": f"r{i}", "conversations": chat}


def _pack(path: Path, out: Path) -> tuple[dict[str, bytes], list[dict]]:
    """The packed dataset's files and rejects of `path`, in chunks of two records."""
    from mmpack.offline_packing.options import job_config
    from mmpack.offline_packing.pipeline import run_pack
    from mmpack.packing.tokenizer import BYTE_TOKENIZER

    cfg = job_config(
        inputs=(str(path),),
        output=str(out),
        seq_len=256,
        tokenizer=BYTE_TOKENIZER,
        progress=False,
        chunk_size=2,
    )
    run_pack(cfg)
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    return dataset_files(out), rejects


def test_an_array_packs_as_read_whole_and_as_its_records_in_json_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pretty-printed array (elements over several lines, chunks of two) packs to the same dataset streamed,
    read whole (the reader of gzip documents) and written as JSON Lines; control: one record less differs."""
    from mmpack.offline_packing.inputs import chunks

    records = [_record(i) for i in range(5)]
    for name, text in [
        ("array", json.dumps(records, indent=2, ensure_ascii=False)),
        ("lines", "".join(json.dumps(r) + "\n" for r in records)),
        ("fewer", "".join(json.dumps(r) + "\n" for r in records[:-1])),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / ("data.json" if name == "array" else "data.jsonl")).write_text(text)
    array = tmp_path / "array" / "data.json"
    assert chunks.input_kind(JobContext(work_dir="unused"), str(array), 1 << 20) == "array"
    streamed, rejects = _pack(array, tmp_path / "streamed")
    assert rejects == []
    monkeypatch.setattr(chunks, "_is_array", lambda ctx, path: False)  # the whole-file reader
    assert _pack(array, tmp_path / "whole")[0] == streamed
    assert _pack(tmp_path / "lines" / "data.jsonl", tmp_path / "lines-out")[0] == streamed
    assert _pack(tmp_path / "fewer" / "data.jsonl", tmp_path / "fewer-out")[0] != streamed


def test_a_malformed_element_is_a_reject_naming_its_index(tmp_path: Path) -> None:
    """Element 2 (0-based) is not valid JSON: one `malformed_json` reject on the line it starts, naming its index
    and saying the rest of the array is not read; the elements before it are packed."""
    items = [json.dumps(_record(i)) for i in range(4)]
    items[2] = '{"id": "r2", "conversations": [ broken'
    path = tmp_path / "data.json"
    path.write_text("[\n" + ",\n".join(items) + "\n]\n")
    _, rejects = _pack(path, tmp_path / "out")
    assert [(r["line"], r["reason"]) for r in rejects] == [(4, "malformed_json")]
    message = rejects[0]["message"]
    assert (
        "invalid JSON at array index 2 (the rest of the array is not read): Expecting value: line 4"
        in message
    )
