"""Further raw sources: WebDataset tars (records + images inside the tar) and Parquet files."""

from __future__ import annotations

import io
import json
import random
import tarfile
from pathlib import Path

import pytest

from mmpack.offline_packing.options import job_config
from mmpack.offline_packing.pipeline import read_manifest, run_pack
from mmpack.packing.tokenizer import BYTE_TOKENIZER
from tests.support.fixtures_data import make_synthetic_dataset, read_arrow_bins, write_image


def _jpeg(tmp: Path, name: str, w: int, h: int, seed: int) -> bytes:
    return write_image(tmp / name, w, h, random.Random(seed)).read_bytes()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _llava(q: str, a: str = "an answer", **extra) -> bytes:
    conv = [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
    return json.dumps({"conversations": conv, **extra}).encode()


@pytest.fixture
def wds_input(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    a = _jpeg(tmp_path, "a.jpg", 80, 60, 1)
    b = _jpeg(tmp_path, "b.jpg", 64, 64, 2)
    c0, c1 = _jpeg(tmp_path, "c0.jpg", 100, 50, 3), _jpeg(tmp_path, "c1.jpg", 50, 100, 4)
    path = tmp_path / "input-000.tar"
    with tarfile.open(path, "w") as tar:
        _add(tar, "s/a.json", _llava("<image>\nWhat?", image="jpg"))  # image named by suffix
        _add(tar, "s/a.jpg", a)
        _add(tar, "s/b.jpg", b)  # caption sample: .txt + one image
        _add(tar, "s/b.txt", b"a blue square")
        _add(tar, "s/c.img0.jpg", c0)  # no image field: every image member, in name order
        _add(tar, "s/c.img1.jpg", c1)
        _add(tar, "s/c.json", _llava("<image>\n<image>\nCompare."))
        _add(tar, "s/d.json", _llava("<image>\nWhat?", image="../../etc/passwd"))  # not a member
        _add(tar, "s/e.json", b'{"conversations": [')  # invalid JSON
        _add(tar, "s/f.cls", b"3")  # no record at all
        _add(tar, "s/g.json", _llava("just text"))
    return path, {"a": a, "b": b, "c0": c0, "c1": c1}


def test_webdataset_tar_input(wds_input, tmp_path: Path) -> None:
    path, images = wds_input
    out = tmp_path / "out"
    summary = run_pack(
        job_config(
            inputs=(str(path),), output=str(out), seq_len=512, tokenizer=BYTE_TOKENIZER, progress=False
        )
    )
    assert (summary.samples_read, summary.samples_packed) == (7, 4)
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert {(r["line"], r["reason"]) for r in rejects} == {
        (4, "missing_image"),
        (5, "malformed_json"),
        (6, "malformed_record"),
    }
    assert all(r["source"] == str(path) for r in rejects)
    m = read_manifest(str(out))
    rows = [r for e in m["shards"] for r in read_arrow_bins(out / e["path"])]
    stored = [img for r in rows for img in r["images"]]
    assert sorted(stored) == sorted(images.values())
    grids = {img: g for r in rows for img, g in zip(r["images"], r["image_grid_thw"])}
    assert grids[images["c0"]] != grids[images["c1"]]  # 100x50 vs 50x100: each image kept its own size


def test_parquet_and_mixed_inputs(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # a fixed schema, as Parquet needs: ShareGPT, caption and text-only records (LLaVA "image" is str or list)
    data = make_synthetic_dataset(
        tmp_path / "raw", n_samples=12, seed=4, formats=("sharegpt", "caption", "text")
    )
    keys = sorted({k for r in data.records for k in r})
    rows = [{k: r.get(k) for k in keys} for r in data.records]
    k = next(i for i, r in enumerate(data.records) if "caption" in r)
    rows[k] = {**rows[k], "image": "images/none.jpg"}  # a missing image
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "raw" / "part.parquet")
    out = tmp_path / "out"
    inputs = (str(tmp_path / "raw" / "part.parquet"), str(data.jsonl_path))
    cfg = job_config(
        inputs=inputs,
        image_root=str(data.image_root),
        output=str(out),
        seq_len=2048,
        tokenizer=BYTE_TOKENIZER,
        progress=False,
    )
    summary = run_pack(cfg)
    assert summary.samples_read == 24 and summary.samples_packed == 23
    (reject,) = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert (reject["source"], reject["line"], reject["reason"]) == (inputs[0], k + 1, "missing_image")
