"""Interop: Megatron-Energon lists and reads `--energon` output; an s3:// output on a local moto server."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmpack.offline_packing.config import PackJobConfig
from mmpack.offline_packing.options import job_config
from mmpack.offline_packing.pipeline import read_manifest, run_pack
from tests.support.fixtures_data import make_synthetic_dataset, read_wds_bins, train_tiny_bpe
from tests.support.shared import need_import


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("raw")
    data = make_synthetic_dataset(root / "data", n_samples=40, seed=7, size_range=(40, 200), max_words=60)
    return data, train_tiny_bpe(root / "tok")


def _cfg(raw, output: str, **kw) -> PackJobConfig:
    data, tok = raw
    return job_config(
        inputs=(str(data.jsonl_path),),
        output=output,
        seq_len=768,
        tokenizer=str(tok),
        max_bins_per_shard=4,
        progress=False,
        **kw,
    )


@pytest.mark.slow
def test_energon_lists_and_reads_packed_bins(raw, tmp_path: Path) -> None:
    need_import("megatron.energon", extra="energon")
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta

    from mmpack.offline_packing.outputs.energon_sample import PackedBinSample

    out = tmp_path / "ds"
    run_pack(_cfg(raw, str(out), format="both", energon=True))
    m = read_manifest(str(out))
    wds_shards = [e for e in m["shards"] if e["format"] == "wds"]

    listed = WebdatasetMeta.from_config(EPath(out), split_part="train")
    assert [(s.name, s.count) for s in listed.shards] == [(e["path"], e["bins"]) for e in wds_shards]

    expected = {r["key"]: r for e in wds_shards for r in read_wds_bins(out / e["path"])}
    ds = get_train_dataset(
        str(out),
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=None,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
    )
    got = {}
    for sample in get_loader(ds):
        assert isinstance(sample, PackedBinSample)
        got[sample.__key__] = sample
    assert sorted(got) == sorted(expected)
    for key, sample in got.items():
        ref = expected[key]
        assert sample.input_ids.tolist() == ref["input_ids"] and sample.loss_mask.tolist() == ref["loss_mask"]
        assert sample.seq_lens.tolist() == ref["seq_lens"] and sample.sample_ids == ref["sample_ids"]
        assert sample.image_grid_thw.tolist() == [list(g) for g in ref["image_grid_thw"]]
        assert len(sample.images) == len(ref["images"])
        for image, encoded in zip(sample.images, ref["images"]):
            w, h = Image.open(io.BytesIO(encoded)).size
            assert tuple(image.shape) == (3, h, w)  # decoded by Energon from the stored bytes

    info = subprocess.run(["energon", "info", str(out)], capture_output=True, text=True)
    assert info.returncode == 0 and "PackedBinSample" in info.stdout
    assert f"{m['counts']['bins']} samples in {len(wds_shards)} shards" in info.stdout


@pytest.mark.slow
def test_s3_output_on_moto(raw, tmp_path: Path) -> None:
    from tests.support.storage_servers import moto_s3  # moto: a test dependency

    with moto_s3() as s3:
        fs = s3.filesystem()
        fs.call_s3("create_bucket", Bucket="packs")  # s3fs mkdir sends a LocationConstraint moto rejects
        url = "s3://packs/run1"
        cfg = _cfg(
            raw, url, format="both", storage_options=s3.storage_options, work_dir=str(tmp_path / "work")
        )
        summary = run_pack(cfg)
        assert summary.samples_read == raw[0].n_samples == summary.samples_packed + summary.samples_rejected
        m = read_manifest(url, s3.storage_options)
        assert m["counts"]["samples_read"] == summary.samples_read
        for e in m["shards"]:
            blob = fs.cat_file(f"packs/run1/{e['path']}")
            assert hashlib.sha256(blob).hexdigest() == e["sha256"] and len(blob) == e["bytes"]
        stats = json.loads(fs.cat_file("packs/run1/stats.json"))
        assert stats["counts"] == m["counts"]
        assert fs.exists("packs/run1/rejects.jsonl")
        assert not [p for p in fs.find("packs/run1") if ".tmp-" in p]

        # same bytes as a local run of the same job
        local = tmp_path / "local"
        run_pack(_cfg(raw, str(local), format="both"))
        for e in m["shards"]:
            assert fs.cat_file(f"packs/run1/{e['path']}") == (local / e["path"]).read_bytes()
        assert fs.cat_file("packs/run1/manifest.json") == (local / "manifest.json").read_bytes()

        again = run_pack(cfg)  # resume: nothing to redo
        assert again.stages_skipped == ["scan", "lengths", "binpack", "write"]
        arrow0 = next(e for e in m["shards"] if e["format"] == "arrow")
        import pyarrow as pa

        table = pa.ipc.open_file(pa.py_buffer(fs.cat_file(f"packs/run1/{arrow0['path']}"))).read_all()
        assert table.num_rows == arrow0["bins"]
        assert np.all(np.array([sum(x) for x in table.column("seq_lens").to_pylist()]) <= 768)
