"""Bad input never stops the job silently: every bad sample lands in rejects.jsonl with file, line, reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmpack.offline_packing.config import PackJobConfig
from mmpack.offline_packing.errors import PackError
from mmpack.offline_packing.inputs.sources import resolve_image_path
from mmpack.offline_packing.options import job_config
from mmpack.offline_packing.pipeline import read_manifest, run_pack
from mmpack.packing.tokenizer import BYTE_TOKENIZER
from tests.support.fixtures_data import make_bad_dataset, read_arrow_bins, write_image


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory):
    return make_bad_dataset(tmp_path_factory.mktemp("bad"))


def _cfg(inputs: list[Path], image_root: Path | None, out: Path, **kw) -> PackJobConfig:
    return job_config(
        inputs=tuple(str(p) for p in inputs),
        image_root=None if image_root is None else str(image_root),
        output=str(out),
        seq_len=kw.pop("seq_len", 512),
        tokenizer=kw.pop("tokenizer", BYTE_TOKENIZER),
        progress=False,
        **kw,
    )


def _rejects(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def packed_bad(bad, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("out") / "ds"
    return out, run_pack(_cfg([bad.jsonl_path], bad.image_root, out))


def test_every_bad_case_is_rejected_with_line_and_reason(bad, packed_bad) -> None:
    out, summary = packed_bad
    rejects = _rejects(out)
    got = {(r["line"], r["reason"]) for r in rejects}
    assert got == {(c.line, c.reason) for c in bad.bad}
    assert all(r["source"] == str(bad.jsonl_path) and r["message"] for r in rejects)
    assert summary.samples_read == bad.n_lines
    assert summary.samples_rejected == len(bad.bad) and summary.samples_packed == bad.n_good
    counts = read_manifest(str(out))["counts"]
    assert counts["samples_read"] == counts["samples_packed"] + counts["samples_rejected"]
    assert sum(counts["rejected_by_reason"].values()) == counts["samples_rejected"]


def test_odd_but_valid_images_are_packed_with_their_true_format(bad, packed_bad) -> None:
    out, _ = packed_bad
    m = read_manifest(str(out))
    rows = [r for e in m["shards"] for r in read_arrow_bins(out / e["path"])]
    by_bytes = {img: fmt for r in rows for img, fmt in zip(r["images"], r["image_formats"])}
    root = bad.image_root
    assert by_bytes[(root / "png_named.jpg").read_bytes()] == "png"  # extension lies: true format kept
    assert by_bytes[(root / "real.webp").read_bytes()] == "webp"
    assert by_bytes[(root / "rgba.png").read_bytes()] == "png"
    assert by_bytes[(root / "gray.jpg").read_bytes()] == "jpg"
    assert sum(len(r["seq_lens"]) for r in rows) == bad.n_good


@pytest.mark.parametrize("workers", [1, 2])
def test_strict_fails_on_first_bad_sample_naming_file_and_line(bad, tmp_path: Path, workers: int) -> None:
    first = min(bad.bad, key=lambda c: c.line)
    cfg = _cfg(
        [bad.jsonl_path], bad.image_root, tmp_path / "strict", strict=True, workers=workers, chunk_size=3
    )
    with pytest.raises(PackError, match=rf"{bad.jsonl_path.name}:{first.line}: {first.reason}"):
        run_pack(cfg)
    assert not (tmp_path / "strict" / "manifest.json").exists()


def test_rewritten_input_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": "one"}]))
    assert run_pack(_cfg([path], None, tmp_path / "a")).samples_read == 1
    path.write_text(json.dumps([{"text": "one"}, {"text": "two, a longer file"}]))
    assert run_pack(_cfg([path], None, tmp_path / "b")).samples_read == 2


def test_json_array_input_reports_element_lines(tmp_path: Path) -> None:
    import random

    write_image(tmp_path / "a.jpg", 64, 64, random.Random(0))
    good = {"image": "a.jpg", "caption": "a cat"}
    text = "[\n  " + json.dumps(good) + ",\n  " + json.dumps({"image": "missing.jpg", "caption": "x"})
    text += ",\n  " + json.dumps({"conversations": []}) + "\n]\n"
    (tmp_path / "d.json").write_text(text)
    out = tmp_path / "out"
    summary = run_pack(_cfg([tmp_path / "d.json"], None, out))  # image root: the file's folder
    assert (summary.samples_read, summary.samples_packed) == (3, 1)
    assert {(r["line"], r["reason"]) for r in _rejects(out)} == {
        (3, "missing_image"),
        (4, "empty_conversation"),
    }


def test_unparsable_json_file_is_one_reject(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text('[{"caption": "x", "image": ')
    (tmp_path / "ok.jsonl").write_text(json.dumps({"text": "just text"}) + "\n\n")
    out = tmp_path / "out"
    summary = run_pack(_cfg([tmp_path], None, out))  # a folder input: both files, sorted
    assert (summary.samples_read, summary.samples_packed) == (2, 1)
    (r,) = _rejects(out)
    assert r["reason"] == "malformed_json" and r["source"].endswith("broken.json")


def test_image_path_escape(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "outside.jpg").write_bytes(b"x")
    (root / "link.jpg").symlink_to(tmp_path / "outside.jpg")
    assert resolve_image_path("sub/../sub/x.jpg", str(root)) == str((root / "sub" / "x.jpg").resolve())
    for bad_path in (
        "../outside.jpg",
        "../../etc/passwd",
        "/etc/passwd",
        str(tmp_path / "outside.jpg"),
        "link.jpg",
        "",
    ):
        with pytest.raises(PermissionError):
            resolve_image_path(bad_path, str(root))


def test_image_check_decode_catches_mid_file_corruption(tmp_path: Path) -> None:
    import random

    img = write_image(tmp_path / "img" / "x.jpg", 300, 200, random.Random(1))
    data = bytearray(img.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 400] = b"\xff" * 400  # broken entropy data, intact end marker
    (tmp_path / "img" / "y.jpg").write_bytes(bytes(data))
    rec = {"image": "y.jpg", "caption": "c"}
    (tmp_path / "d.jsonl").write_text(json.dumps(rec) + "\n")
    inputs, root = [tmp_path / "d.jsonl"], tmp_path / "img"
    header = run_pack(_cfg(inputs, root, tmp_path / "header", image_check="header"))
    assert (header.samples_read, header.samples_packed) == (1, 1)  # the header and end marker look fine
    decode = run_pack(_cfg(inputs, root, tmp_path / "decode", image_check="decode"))
    assert (decode.samples_read, decode.samples_rejected) == (1, 1)
    assert decode.rejected_by_reason == {"unreadable_image": 1}


def test_all_rejected_input_gives_an_empty_committed_dataset(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"bad": 1}\n\n{"conversations": []}\n')
    out = tmp_path / "out"
    summary = run_pack(_cfg([tmp_path / "d.jsonl"], None, out, format="both"))
    assert (summary.samples_read, summary.samples_packed, summary.bins) == (2, 0, 0)
    m = read_manifest(str(out))
    assert m["shards"] == [] and m["counts"]["samples_rejected"] == 2
    assert [r["line"] for r in _rejects(out)] == [1, 3]
