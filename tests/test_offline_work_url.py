"""The work folder as a URL (`-w s3://...`): stage outputs and markers live in the object store, each run
works from a fresh local cache of it, and the job writes what it writes with a local work folder; reruns
resume from the URL's markers alone, and redo only what is missing there."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from mmpack.offline_packing.options import job_config
from mmpack.offline_packing.pipeline import resolve_work_dir, run_pack
from mmpack.packing.tokenizer import BYTE_TOKENIZER
from tests.support.fixtures_data import (
    dataset_files,
    make_synthetic_dataset,
    small_job_config,
    train_tiny_bpe,
)
from tests.support.storage_servers import moto_s3

ALL_STAGES = ["scan", "lengths", "binpack", "write"]


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("raw")
    data = make_synthetic_dataset(root / "data", n_samples=40, seed=3, size_range=(40, 200), max_words=60)
    with data.jsonl_path.open("a") as f:  # a reject too: rejects.jsonl is gathered from the work folder
        f.write('{"id": "bad", "image": "images/absent.jpg", "caption": "x"}\n')
    return data.jsonl_path, train_tiny_bpe(root / "tok")


_cfg = small_job_config


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as endpoint:
        yield endpoint


def _objects(fs: Any, url: str) -> dict[str, str]:
    """Relative key -> ETag of every object under `url`."""
    root = url.removeprefix("s3://")
    fs.invalidate_cache()
    return {k[len(root) + 1 :]: str(v["ETag"]) for k, v in fs.find(root, detail=True).items()}


def _caches(url: str) -> list[Path]:
    import hashlib

    d = Path(tempfile.gettempdir()) / "mmpack-work" / hashlib.sha256(url.encode()).hexdigest()[:16]
    return sorted(p for p in d.glob("*") if p.is_dir()) if d.is_dir() else []


@pytest.mark.slow
def test_work_folder_on_s3(raw, s3, tmp_path: Path) -> None:
    local = tmp_path / "local"
    run_pack(_cfg(raw, local, workers=2))
    fs = s3.make_bucket("work")
    work = "s3://work/job"
    out = tmp_path / "out"
    opts = s3.storage_options
    first = run_pack(_cfg(raw, out, work_dir=work, storage_options=opts, workers=2))
    assert first.stages_skipped == [] and first.samples_rejected == 1
    assert dataset_files(out) == dataset_files(local)
    assert not (out / "_work").exists()
    objects = _objects(fs, work)
    assert {f"{s}.done.json" for s in ALL_STAGES} <= set(objects)
    assert any(k.startswith("lengths/chunk-") and k.endswith(".ids.npy") for k in objects)
    assert "binpack/order.npy" in objects and "write/written.json" in objects
    assert _caches(work) == []  # the local cache goes with the run: the URL holds everything

    # a rerun resumes from the URL's markers: nothing is redone
    assert run_pack(_cfg(raw, out, work_dir=work, storage_options=opts)).stages_skipped == ALL_STAGES

    # as after a crash in the middle of lengths: only the missing chunk (and what follows) is redone
    fs.rm(["work/job/lengths.done.json", "work/job/lengths/chunk-000002.done.json"])
    kept = {k: v for k, v in objects.items() if k.startswith("lengths/chunk-") and "000002" not in k}
    before = {k: fs.info(f"work/job/{k}")["LastModified"] for k in kept}
    time.sleep(1.1)  # LastModified has a resolution of one second: a rewrite would show
    again = run_pack(_cfg(raw, out, work_dir=work, storage_options=opts))
    assert again.stages_skipped == ["scan"]
    assert {k: fs.info(f"work/job/{k}")["LastModified"] for k in kept} == before  # not rewritten
    assert "lengths/chunk-000002.done.json" in _objects(fs, work)
    assert dataset_files(out) == dataset_files(local)

    # control: with the URL's work gone, everything is redone (the markers were read from the URL)
    fs.rm("work/job", recursive=True)
    assert run_pack(_cfg(raw, out, work_dir=work, storage_options=opts)).stages_skipped == []
    assert dataset_files(out) == dataset_files(local)

    # --clean-work removes the work folder at the URL
    run_pack(_cfg(raw, out, work_dir=work, storage_options=opts, clean_work=True))
    assert _objects(fs, work) == {}


def test_forced_stage_clears_markers_at_the_url(raw, s3, tmp_path: Path) -> None:
    """`-S 2` redoes every lengths chunk: their markers are removed at the URL, not only in a local cache (a
    marker left at the URL would make the chunk look done)."""
    fs = s3.make_bucket("work")
    work = "s3://work/forced"
    out = tmp_path / "out"
    opts = s3.storage_options
    run_pack(_cfg(raw, out, work_dir=work, storage_options=opts))
    arrays = [k for k in _objects(fs, work) if k.startswith("lengths/") and k.endswith(".ids.npy")]
    stamp = lambda: {k: fs.info(f"work/forced/{k}")["LastModified"] for k in arrays}  # noqa: E731
    before = stamp()
    time.sleep(1.1)  # LastModified has a resolution of one second
    summary = run_pack(_cfg(raw, out, work_dir=work, storage_options=opts, start_stage=2))
    assert summary.stages_skipped == [] and "lengths" in summary.stage_seconds
    fs.invalidate_cache()
    after = stamp()
    assert arrays and all(after[k] > before[k] for k in arrays), (before, after)


def test_default_work_folder(tmp_path: Path) -> None:
    """Local output: `<output>/_work`. URL output: a local temp folder on one machine, `<output>/_work` under
    Ray (every node must reach it); `-w` always wins."""
    base: dict[str, Any] = dict(inputs=("x.jsonl",), seq_len=64, tokenizer=BYTE_TOKENIZER)
    assert resolve_work_dir(job_config(output=str(tmp_path / "o"), **base)) == str(tmp_path / "o" / "_work")
    url_local = resolve_work_dir(job_config(output="s3://b/o", **base))
    assert url_local.startswith(tempfile.gettempdir())
    assert resolve_work_dir(job_config(output="s3://b/o", engine="ray", **base)) == "s3://b/o/_work"
    assert resolve_work_dir(job_config(output="s3://b/o", engine="ray", work_dir="s3://w/x", **base)) == (
        "s3://w/x"
    )
