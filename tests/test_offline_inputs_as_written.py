"""Inputs read as users write them, resource limits, and modalities not supported yet: each finding is a
reject with its file, line and reason, never a crash, a silent repair or a silent drop."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from PIL import Image

from mmpack.offline_packing.options import job_config
from mmpack.offline_packing.pipeline import read_manifest, run_pack
from mmpack.packing.tokenizer import BYTE_TOKENIZER


def _llava(i: int, img: str | None = None) -> dict:
    q = ("<image>\n" if img else "") + f"question {i}?"
    rec: dict = {
        "id": f"r{i}",
        "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": f"a{i}"}],
    }
    if img:
        rec["image"] = img
    return rec


def _pack(path: Path, tmp: Path, **kw) -> tuple[dict, list[dict]]:
    out = tmp / f"out-{path.name}"
    cfg = job_config(
        inputs=(str(path),), output=str(out), seq_len=512, tokenizer=BYTE_TOKENIZER, progress=False, **kw
    )
    run_pack(cfg)
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    return read_manifest(str(out))["counts"], rejects


RECORDS = [_llava(i) for i in range(5)]
JSONL = "".join(json.dumps(r) + "\n" for r in RECORDS).encode()
ARRAY = json.dumps(RECORDS, indent=1).encode()


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("bom_array.json", b"\xef\xbb\xbf" + ARRAY),
        ("jsonl_content.json", JSONL),
        ("bom_jsonl_content.json", b"\xef\xbb\xbf" + JSONL),
        ("bom.jsonl", b"\xef\xbb\xbf" + JSONL),
        ("crlf.jsonl", JSONL.replace(b"\n", b"\r\n")),
        ("crlf_array.json", ARRAY.replace(b"\n", b"\r\n")),
        ("crlf_content.json", JSONL.replace(b"\n", b"\r\n")),
        ("gz.jsonl.gz", gzip.compress(JSONL)),
        ("gz.json.gz", gzip.compress(b"\xef\xbb\xbf" + ARRAY)),
        ("gz_lines.json.gz", gzip.compress(JSONL)),
    ],
)
def test_every_record_of_a_file_as_users_write_it_is_read(tmp_path: Path, name: str, data: bytes) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    counts, rejects = _pack(path, tmp_path)
    assert rejects == []
    assert counts["samples_read"] == counts["samples_packed"] == 5


def test_jsonl_in_json_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "mixed.json"
    lines = JSONL.decode().splitlines()
    lines[2] = '{"conversations": [ broken'
    path.write_text("\n".join(lines) + "\n")
    counts, rejects = _pack(path, tmp_path)
    assert counts["samples_read"] == 5 and counts["samples_packed"] == 4
    assert [(r["line"], r["reason"]) for r in rejects] == [(3, "malformed_json")]


@pytest.mark.parametrize("name", ["bad_utf8.json", "bad_utf8.jsonl", "bad_utf8.json.gz"])
def test_invalid_utf8_is_a_reject_with_its_line_never_a_replacement(tmp_path: Path, name: str) -> None:
    recs = [json.dumps(r).encode() for r in RECORDS]
    recs[3] = recs[3].replace(b"question 3", b"question \xff\xfe 3")
    body = (
        b"[\n" + b",\n".join(recs) + b"\n]\n"
        if name.startswith("bad_utf8.json")
        else b"\n".join(recs) + b"\n"
    )
    if name.endswith(".jsonl"):
        body = b"\n".join(recs) + b"\n"
    path = tmp_path / name
    path.write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    counts, rejects = _pack(path, tmp_path)
    assert counts["samples_read"] == 5 and counts["samples_packed"] == 4
    assert len(rejects) == 1 and rejects[0]["reason"] == "malformed_json"
    assert rejects[0]["line"] == (
        5 if not name.endswith(".jsonl") else 4
    )  # array: element 4 starts on line 5
    assert "UTF-8" in rejects[0]["message"]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_deeply_nested_record_is_one_reject_not_a_crash(tmp_path: Path, suffix: str) -> None:
    deep = '{"conversations": ' + "[" * 100_000 + "]" * 100_000 + "}"
    good = [json.dumps(r) for r in RECORDS[:3]]
    lines = [good[0], deep, good[1], good[2]]
    text = "\n".join(lines) + "\n" if suffix == ".jsonl" else "[\n" + ",\n".join(lines) + "\n]\n"
    path = tmp_path / f"deep{suffix}"
    path.write_text(text)
    counts, rejects = _pack(path, tmp_path)
    assert counts["samples_read"] == 4 and counts["samples_packed"] == 3
    line = 2 if suffix == ".jsonl" else 3  # the array's "[" is line 1
    assert [(r["line"], r["reason"]) for r in rejects] == [(line, "malformed_record")]
    assert "nested deeper" in rejects[0]["message"]


def _image_dataset(tmp: Path, records: list[dict]) -> Path:
    path = tmp / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_image_over_max_image_pixels_is_rejected_from_the_header(tmp_path: Path) -> None:
    Image.new("1", (12000, 12000)).save(tmp_path / "huge.png", optimize=True)  # 144 MP in a few KB
    assert (tmp_path / "huge.png").stat().st_size < 50_000
    Image.new("RGB", (64, 48), (3, 4, 5)).save(tmp_path / "ok.png")
    path = _image_dataset(tmp_path, [_llava(0, "huge.png"), _llava(1, "ok.png")])
    counts, rejects = _pack(path, tmp_path)
    assert counts["samples_packed"] == 1
    assert [(r["line"], r["reason"]) for r in rejects] == [(1, "image_too_large")]
    assert "40000000" in rejects[0]["message"]
    manifest = read_manifest(str(tmp_path / "out-data.jsonl"))
    assert manifest["image_rule"]["max_image_pixels"] == 40_000_000
    # a lower limit set by the flag is applied and recorded
    counts, rejects = _pack(path, tmp_path / "low", max_image_pixels=64 * 48 - 1)
    assert counts["samples_packed"] == 0 and {r["reason"] for r in rejects} == {"image_too_large"}
    assert read_manifest(str(tmp_path / "low" / "out-data.jsonl"))["image_rule"]["max_image_pixels"] == 3071


@pytest.mark.parametrize(
    ("record", "reason", "words"),
    [
        # videos are supported: a video without its <video> tag (or a tag without a video) is a mismatch
        ({**_llava(0), "video": "clip.mp4"}, "video_tag_mismatch", "0 <video> tags but 1 videos"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                "videos": ["a.mp4"],
            },
            "video_tag_mismatch",
            "0 <video> tags but 1 videos",
        ),
        (
            {
                "conversations": [
                    {"from": "human", "value": "<video>\nWhat happens?"},
                    {"from": "gpt", "value": "x"},
                ]
            },
            "video_tag_mismatch",
            "1 <video> tags but 0 videos",
        ),
        ({**_llava(0), "audio": "a.wav"}, "unsupported_modality", "'audio'"),
        (
            {
                **_llava(0),
                "system_prompt": "Be brief.",
                "conversations": [{"from": "system", "value": "S"}, *_llava(0)["conversations"]],
            },
            "malformed_record",
            "system_prompt",
        ),
        ({**_llava(0, "ok.png"), "images": ["ok.png"]}, "malformed_record", "'images'"),
    ],
    ids=["video_key", "videos_key", "video_tag", "audio_key", "system_conflict", "image_and_images"],
)
def test_unsupported_modalities_and_conflicts_are_rejects(
    tmp_path: Path, record: dict, reason: str, words: str
) -> None:
    Image.new("RGB", (64, 48), (3, 4, 5)).save(tmp_path / "ok.png")
    path = _image_dataset(tmp_path, [_llava(1), record])
    counts, rejects = _pack(path, tmp_path)
    assert counts["samples_packed"] == 1
    assert [(r["line"], r["reason"]) for r in rejects] == [(2, reason)]
    assert words in rejects[0]["message"]


def test_truncated_samples_are_counted(tmp_path: Path) -> None:
    long = {
        "conversations": [
            {"from": "human", "value": "q1"},
            {"from": "gpt", "value": "short answer"},
            {"from": "human", "value": "q2"},
            {"from": "gpt", "value": "word " * 400},
        ]
    }
    path = _image_dataset(tmp_path, [_llava(0), long])
    out = tmp_path / "out"
    summary = run_pack(
        job_config(
            inputs=(str(path),),
            output=str(out),
            seq_len=256,
            tokenizer=BYTE_TOKENIZER,
            overlength="truncate",
            progress=False,
        )
    )
    assert read_manifest(str(out))["counts"]["truncated"] == 1 == summary.samples_truncated
    assert "samples truncated" in summary.format_table()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{\n "conversations": [],\n "id": "x"\n}\n', [(1, None)]),  # one pretty-printed object: one record
        ('{\n "conversations": [\n', [(1, "malformed_json")]),  # one broken object: one reject, not per line
        ('{"a": \n{"b": 1}\n{"c": 2}\n', [(1, "malformed_json"), (2, None), (3, None)]),  # JSONL, bad line 1
        ('\n\n{"a": 1}\n\n{"b": 2}\n', [(3, None), (5, None)]),  # blank lines keep the line numbers
        ("[]", []),
        ("", []),
    ],
    ids=["object", "broken_object", "jsonl_bad_first", "blank_lines", "empty_array", "empty_file"],
)
def test_json_document_forms(text: str, expected: list) -> None:
    from mmpack.offline_packing.inputs.json_records import parse_json_document

    records = parse_json_document(text.encode())
    assert [(r.line, r.error_reason if r.error else None) for r in records] == expected


def test_nesting_limit_is_exact() -> None:
    from mmpack.offline_packing.inputs.json_records import MAX_NESTING_DEPTH, parse_json_line

    at_limit = "[" * MAX_NESTING_DEPTH + "]" * MAX_NESTING_DEPTH
    over = "[" * (MAX_NESTING_DEPTH + 1) + "]" * (MAX_NESTING_DEPTH + 1)
    assert parse_json_line(at_limit.encode(), 1).error is None
    assert parse_json_line(over.encode(), 1).error_reason == "malformed_record"
    # brackets inside strings do not count
    assert parse_json_line(json.dumps({"t": "[" * 500}).encode(), 1).error is None
