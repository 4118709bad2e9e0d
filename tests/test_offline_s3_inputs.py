"""Inputs as URLs: the offline job reading raw records (JSONL, Parquet, WebDataset) and images from a moto S3
server on 127.0.0.1 writes what the same job writes from a local copy; scan fetches only image headers;
transient errors are retried; a persistent one names the object; reruns see unchanged objects as unchanged."""

from __future__ import annotations

import io
import json
import tarfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmpack.offline_packing.config import PackJobConfig
from mmpack.offline_packing.inputs import remote
from mmpack.offline_packing.options import job_config
from mmpack.offline_packing.pipeline import run_pack
from mmpack.packing.retry import RetryPolicy
from tests.support.fixtures_data import dataset_files, make_synthetic_dataset, train_tiny_bpe
from tests.support.storage_servers import FaultPlan, FaultProxy, http_server, moto_s3, s3_storage_options

SEQ_LEN = 1024


def _with_ids(jsonl: Path) -> None:
    """Give every record an id: records without one are named after their source (path or URL)."""
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    for i, row in enumerate(rows):
        row.setdefault("id", f"rec-{i}")
    jsonl.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def _noisy_jpeg(width: int, height: int, seed: int) -> bytes:
    """A JPEG of noise (hardly compressible): large next to its header."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _write_tar(path: Path, samples: list[tuple[str, dict, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, record, image in samples:
            for name, data in ((f"{key}.json", json.dumps(record).encode()), (f"{key}.jpg", image)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A folder with data.jsonl (+ images/), captions.parquet and a WebDataset tar; a tiny tokenizer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("raw") / "data"
    data = make_synthetic_dataset(root, n_samples=48, seed=5, size_range=(40, 260), max_words=60)
    _with_ids(data.jsonl_path)
    rel = [p.relative_to(root).as_posix() for p in data.image_paths]
    captions = [
        {"id": f"pq-{i}", "image": rel[i % len(rel)], "caption": f"a picture number {i}"} for i in range(9)
    ]
    pq.write_table(pa.Table.from_pylist(captions), root / "captions.parquet")
    big = root / "big"
    big.mkdir()
    for i in range(6):
        (big / f"noise_{i}.jpg").write_bytes(_noisy_jpeg(640 + 16 * i, 480, seed=i))
    samples = [
        (f"s{i:03d}", {"id": f"wds-{i}", "caption": f"tar sample {i}"}, _noisy_jpeg(64, 48 + i, seed=100 + i))
        for i in range(5)
    ]
    _write_tar(root / "shard-000.tar", samples)
    return root, train_tiny_bpe(root.parent / "tok")


def _cfg(inputs: list[str], out: Path, tok: Path, **kw: Any) -> PackJobConfig:
    base: dict[str, Any] = dict(
        inputs=tuple(inputs),
        output=str(out),
        seq_len=SEQ_LEN,
        tokenizer=str(tok),
        format="both",
        max_bins_per_shard=4,
        chunk_size=8,
        progress=False,
    )
    base.update(kw)
    return job_config(**base)


INPUT_NAMES = ("data.jsonl", "captions.parquet", "shard-000.tar")


@pytest.fixture(scope="module")
def s3(raw: tuple[Path, Path]):
    root, _ = raw
    with moto_s3() as endpoint:
        url = endpoint.upload_folder(root, "raw", "v1")
        yield endpoint, url


@pytest.fixture(scope="module")
def local_run(raw: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    root, tok = raw
    out = tmp_path_factory.mktemp("local") / "out"
    run_pack(_cfg([str(root / n) for n in INPUT_NAMES], out, tok))
    return dataset_files(out)


def _same_dataset(a: dict[str, bytes], b: dict[str, bytes], src_a: str, src_b: str) -> None:
    """Byte-equal files; rejects.jsonl names its sources, so it is compared with `src_b` read as `src_a`."""
    assert sorted(a) == sorted(b)
    for name in a:
        if name == "rejects.jsonl":
            assert a[name] == b[name].replace(src_b.encode(), src_a.encode())
        else:
            assert a[name] == b[name], name


@pytest.mark.slow
def test_s3_inputs_equal_local_copy(raw, s3, local_run, tmp_path: Path) -> None:
    root, tok = raw
    endpoint, url = s3
    out = tmp_path / "out"
    cfg = _cfg([f"{url}/{n}" for n in INPUT_NAMES], out, tok, storage_options=endpoint.storage_options)
    summary = run_pack(cfg)
    assert summary.samples_packed > 0 and summary.samples_read == 48 + 9 + 5
    got = dataset_files(out)
    _same_dataset(local_run, got, str(root), url)
    assert any(name.startswith("shards/") for name in got)
    # control: a different job (another seed) is not equal, so the comparison can fail
    other = tmp_path / "other"
    run_pack(
        _cfg(
            [f"{url}/{n}" for n in INPUT_NAMES], other, tok, seed=1, storage_options=endpoint.storage_options
        )
    )
    with pytest.raises(AssertionError):
        _same_dataset(local_run, dataset_files(other), str(root), url)


def test_s3_folder_input_and_image_root(raw, s3, tmp_path: Path) -> None:
    """A prefix as -i expands to its input objects in sorted order; -r may be a URL too."""
    root, tok = raw
    endpoint, url = s3
    opts = endpoint.storage_options
    local_out, remote_out = tmp_path / "a", tmp_path / "b"
    run_pack(_cfg([str(root)], local_out, tok, image_root=str(root)))
    run_pack(_cfg([url], remote_out, tok, image_root=url + "/", storage_options=opts))
    _same_dataset(dataset_files(local_out), dataset_files(remote_out), str(root), url)


def test_http_inputs_equal_local_copy(raw, local_run, tmp_path: Path) -> None:
    """Plain HTTP (no listing, no Range support in `http.server`): each object named, same output."""
    root, tok = raw
    with http_server(root) as base:
        out = tmp_path / "out"
        # the S3 options of the job (for an s3:// output, say) are not given to the HTTP client
        opts = s3_storage_options("http://127.0.0.1:1")
        run_pack(_cfg([f"{base}/{n}" for n in INPUT_NAMES], out, tok, storage_options=opts))
    _same_dataset(local_run, dataset_files(out), str(root), base)


def test_file_urls_are_local_paths(raw, local_run, tmp_path: Path) -> None:
    root, tok = raw
    out = tmp_path / "out"
    run_pack(_cfg([f"file://{root / n}" for n in INPUT_NAMES], out, tok, image_root=f"file://{root}"))
    assert dataset_files(out) == local_run


class CountingProxy(FaultProxy):
    """A FaultProxy that also counts the bytes it sends back for GETs of paths containing `count_part`."""

    def __init__(self, upstream: str, plan: FaultPlan, count_part: str):
        super().__init__(upstream, plan)
        self.count_part = count_part
        self.sent_bytes = 0
        self.gets = 0
        self._count_lock = threading.Lock()

    def _forward(self, h: Any) -> None:
        if h.command == "GET" and self.count_part in h.path:
            wfile, proxy = h.wfile, self

            class Counted:
                def write(self, data: bytes) -> int:
                    with proxy._count_lock:
                        proxy.sent_bytes += len(data)
                    return wfile.write(data)

                def flush(self) -> None:
                    wfile.flush()

            with self._count_lock:
                self.gets += 1
            h.wfile = Counted()
            try:
                super()._forward(h)
            finally:
                h.wfile = wfile
            return
        super()._forward(h)


def _big_records(root: Path, tmp: Path) -> Path:
    src = tmp / "big.jsonl"
    names = sorted(p.name for p in (root / "big").iterdir())
    src.write_text(
        "".join(
            json.dumps({"id": f"b{i}", "image": f"big/{n}", "caption": "noise"}) + "\n"
            for i, n in enumerate(names)
        )
    )
    return src


def test_scan_reads_image_headers_only(raw, s3, tmp_path: Path) -> None:
    root, tok = raw
    endpoint, url = s3
    total = sum(p.stat().st_size for p in (root / "big").iterdir())
    proxy = CountingProxy(endpoint.endpoint_url, FaultPlan(kinds=()), count_part="/big/")
    with proxy:
        opts = s3_storage_options(proxy.url)
        cfg = _cfg(
            [str(_big_records(root, tmp_path))],
            tmp_path / "out",
            tok,
            image_root=url,
            storage_options=opts,
            only_stage=1,
        )
        run_pack(cfg)
        scanned = proxy.sent_bytes
        assert proxy.gets >= 6
        # the header block and the end-marker block of each image (plus response headers), not the images
        assert scanned < total / 5, (scanned, total)
        assert scanned < 6 * (2 * remote.HEADER_BLOCK_BYTES + 2048)
        run_pack(
            _cfg(
                [str(_big_records(root, tmp_path))],
                tmp_path / "out",
                tok,
                image_root=url,
                storage_options=opts,
            )
        )
        # control: the write stage copies whole images, and the proxy sees them
        assert proxy.sent_bytes - scanned >= total


def _no_s3fs_retries(monkeypatch) -> None:
    """s3fs retries some errors itself (with its own sleeps); off, so the job's retries are what is tested."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)


@pytest.mark.slow  # ~20 s: every object of the job fails once first
def test_transient_errors_are_retried(raw, s3, local_run, tmp_path: Path, monkeypatch) -> None:
    """Every object GET fails once (503 or a reset connection) before it succeeds: same output."""
    root, tok = raw
    endpoint, url = s3
    monkeypatch.setattr(remote, "RETRY", RetryPolicy(max_attempts=5, backoff_s=0.01))
    _no_s3fs_retries(monkeypatch)
    plan = FaultPlan(kinds=("503", "reset"), max_faults_per_path=1, fault_path_part="/raw/")
    with FaultProxy(endpoint.endpoint_url, plan) as proxy:
        opts = s3_storage_options(proxy.url)
        out = tmp_path / "out"
        run_pack(_cfg([f"{url}/{n}" for n in INPUT_NAMES], out, tok, storage_options=opts))
        assert proxy.faults_injected > 10
    _same_dataset(local_run, dataset_files(out), str(root), url)


def test_persistent_error_names_the_object(raw, s3, tmp_path: Path, monkeypatch) -> None:
    root, tok = raw
    endpoint, url = s3
    monkeypatch.setattr(remote, "RETRY", RetryPolicy(max_attempts=5, backoff_s=0.001))
    _no_s3fs_retries(monkeypatch)
    plan = FaultPlan(kinds=("503",), max_faults_per_path=10**6, fault_path_part="/noise_3.jpg")
    with FaultProxy(endpoint.endpoint_url, plan) as proxy:
        cfg = _cfg(
            [str(_big_records(root, tmp_path))],
            tmp_path / "out",
            tok,
            image_root=url,
            storage_options=s3_storage_options(proxy.url),
        )
        with pytest.raises(remote.InputReadError, match=r"s3://raw/v1/big/noise_3\.jpg after 5 attempts"):
            run_pack(cfg)


def test_missing_objects(raw, s3, tmp_path: Path) -> None:
    _, tok = raw
    endpoint, url = s3
    opts = endpoint.storage_options
    with pytest.raises(FileNotFoundError, match=r"s3://raw/v1/nothing\.jsonl"):
        run_pack(_cfg([f"{url}/nothing.jsonl"], tmp_path / "a", tok, storage_options=opts))
    src = tmp_path / "missing.jsonl"
    src.write_text(json.dumps({"id": "m", "image": "big/absent.jpg", "caption": "x"}) + "\n")
    summary = run_pack(_cfg([str(src)], tmp_path / "b", tok, image_root=url, storage_options=opts))
    assert summary.rejected_by_reason == {"missing_image": 1}
    reject = json.loads((tmp_path / "b" / "rejects.jsonl").read_text())
    assert f"{url}/big/absent.jpg" in reject["message"]
    with pytest.raises(PermissionError, match="escapes"):
        remote.join_under(url, "../v2/x.jpg")


def test_rerun_sees_unchanged_and_changed_objects(raw, s3, tmp_path: Path) -> None:
    """Stage fingerprints take a URL's identity (URL, size, ETag): an unchanged object skips, a rewritten
    image redoes scan and every stage after it."""
    root, tok = raw
    endpoint, _ = s3
    opts = endpoint.storage_options
    fs = endpoint.filesystem()
    fs.put_file(str(root / "big" / "noise_0.jpg"), "raw/v2/big/noise_0.jpg")
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"id": "one", "image": "big/noise_0.jpg", "caption": "x"}) + "\n")
    cfg = _cfg([str(src)], tmp_path / "out", tok, image_root="s3://raw/v2", storage_options=opts)
    first = run_pack(cfg)
    assert run_pack(cfg).stages_skipped == ["scan", "lengths", "binpack", "write"]
    fs.pipe_file("raw/v2/big/noise_0.jpg", _noisy_jpeg(200, 100, seed=9))
    again = run_pack(cfg)
    assert again.stages_skipped == [] and "scan" in again.stage_seconds
    assert again.image_tokens != first.image_tokens  # the new image's size was read
