"""Nothing of the user's is destroyed by `mmpack pack`: folders without mmpack's marker are refused, --clean-work
deletes only the work folder's own files, one job at a time per output, and the job never reads its own files."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from mmpack.offline_packing.config import PackJobConfig
from mmpack.offline_packing.errors import PackError
from mmpack.offline_packing.inputs.sources import is_input_file
from mmpack.offline_packing.options import job_config
from mmpack.offline_packing.pipeline import run_pack
from mmpack.packing.joblock import LOCK_NAME, FolderLocked, hold_lock
from mmpack.packing.ownership import MARKER_NAME, FolderNotOwned, claim_folder, has_marker
from mmpack.packing.tokenizer import BYTE_TOKENIZER
from tests.support.fixtures_data import dataset_files, make_synthetic_dataset
from tests.support.storage_servers import moto_s3


def _cfg(data_dir: Path | str, out: str | Path, **kw) -> PackJobConfig:
    return job_config(
        inputs=(str(data_dir),),
        output=str(out),
        seq_len=512,
        progress=False,
        chunk_size=6,
        tokenizer=BYTE_TOKENIZER,
        **kw,
    )


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("raw")
    make_synthetic_dataset(root, n_samples=14, seed=3, size_range=(30, 80), max_words=20)
    return root


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as endpoint:
        yield endpoint


@pytest.mark.parametrize(
    "name", ["manifest.json", "stats.json", "rejects.jsonl", "shards/packed-000000.arrow"]
)
def test_output_holding_users_files_is_refused_and_left_as_is(raw: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / "out"
    (out / name).parent.mkdir(parents=True)
    (out / name).write_bytes(b"the user's own file")
    with pytest.raises(FolderNotOwned, match=r"output \(-o\) .* not empty and was not made by mmpack"):
        run_pack(_cfg(raw, out))
    assert _tree(out) == {name: b"the user's own file"}


def test_clean_work_refuses_foreign_folders_and_deletes_only_its_own_files(raw: Path, tmp_path: Path) -> None:
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    out = tmp_path / "out"
    for work, match in [(user, "work folder .* not empty"), (raw, "work folder .* not empty")]:
        before = _tree(work)
        with pytest.raises(FolderNotOwned, match=match):
            run_pack(_cfg(raw, out, work_dir=str(work), clean_work=True))
        assert _tree(work) == before
    run_pack(_cfg(raw, out))  # a finished dataset, then --clean-work pointed at it
    dataset = dataset_files(out)
    with pytest.raises(PackError, match="are one folder"):
        run_pack(_cfg(raw, out, work_dir=str(out), clean_work=True))
    with pytest.raises(FolderNotOwned, match="mmpack's 'dataset' folder, not a 'work' one"):
        run_pack(_cfg(raw, tmp_path / "out2", work_dir=str(out), clean_work=True))
    assert dataset_files(out) == dataset
    # a marked work folder: its own files go, a file someone put there stays, and so does the folder
    work = tmp_path / "work"
    run_pack(_cfg(raw, tmp_path / "out3", work_dir=str(work)))
    (work / "scan" / "keep-me.txt").write_text("not mmpack's")
    run_pack(_cfg(raw, tmp_path / "out3", work_dir=str(work), clean_work=True))
    assert _tree(work) == {
        MARKER_NAME: (work / MARKER_NAME).read_bytes(),
        "scan/keep-me.txt": b"not mmpack's",
    }
    run_pack(_cfg(raw, tmp_path / "out4", clean_work=True))  # the default <out>/_work goes completely
    assert not (tmp_path / "out4" / "_work").exists() and has_marker(tmp_path / "out4")
    assert dataset_files(tmp_path / "out4") == dataset


def test_clean_work_never_touches_a_bucket(raw: Path, tmp_path: Path, s3) -> None:
    fs = s3.make_bucket("users-bucket")
    fs.pipe_file("users-bucket/precious/data.bin", b"irreplaceable")
    opts = s3.storage_options
    with pytest.raises(FolderNotOwned, match="s3://users-bucket is not empty"):
        run_pack(
            _cfg(raw, tmp_path / "o", work_dir="s3://users-bucket", clean_work=True, storage_options=opts)
        )
    fs.invalidate_cache()
    assert fs.find("users-bucket") == ["users-bucket/precious/data.bin"]
    s3.make_bucket("empty-bucket")  # an empty bucket may be a work folder; cleaning it leaves the bucket
    run_pack(_cfg(raw, tmp_path / "o2", work_dir="s3://empty-bucket", clean_work=True, storage_options=opts))
    fs.invalidate_cache()
    assert fs.exists("empty-bucket") and fs.find("empty-bucket") == []


def test_a_second_job_on_the_same_output_fails_at_once_naming_the_first(
    raw: Path, tmp_path: Path, monkeypatch
) -> None:
    import mmpack.offline_packing.pipeline as pipeline_module

    out = tmp_path / "out"
    started, release = threading.Event(), threading.Event()
    real = pipeline_module.run_binpack

    def paused(*args, **kwargs):
        started.set()
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_module, "run_binpack", paused)
    first: dict = {}
    job = threading.Thread(target=lambda: first.setdefault("summary", run_pack(_cfg(raw, out))))
    job.start()
    try:
        assert started.wait(60)
        holder = json.loads((out / LOCK_NAME).read_text())
        with pytest.raises(
            FolderLocked, match=rf"output \(-o\) {out} is in use by another mmpack job: pid {holder['pid']}"
        ):
            run_pack(_cfg(raw, out, seed=7))  # another job into the same output
        with pytest.raises(FolderLocked, match="is in use by another mmpack job"):
            run_pack(_cfg(raw, tmp_path / "elsewhere", work_dir=str(out / "_work")))  # its work folder
    finally:
        release.set()
        job.join(60)
    assert first["summary"].samples_read == 14 and not (out / LOCK_NAME).exists()
    assert run_pack(_cfg(raw, out)).stages_skipped == ["scan", "lengths", "binpack", "write"]


def test_object_store_output_lease_refuses_a_live_holder_and_takes_over_a_stale_one(
    raw: Path, tmp_path: Path, s3
) -> None:
    fs = s3.make_bucket("leases")
    opts = s3.storage_options
    url = "s3://leases/ds"
    claim_folder(url, "dataset", storage_options=opts)  # what a first job does, then it locks the folder
    busy = rf"output \(-o\) {url} is in use by another mmpack job: pid \d+"
    with hold_lock(url, role="output (-o)", storage_options=opts), pytest.raises(FolderLocked, match=busy):
        run_pack(_cfg(raw, url, storage_options=opts))
    fs.invalidate_cache()
    assert not fs.exists(f"leases/ds/{LOCK_NAME}")  # released at the end of the block
    killed = {"host": "node-7", "pid": 99, "command": "mmpack pack", "started": "2020-01-01T00:00:00Z"}
    stale = {**killed, "renewed": "2020-01-01T00:00:00Z", "ttl_s": 600}
    fs.pipe_file(f"leases/ds/{LOCK_NAME}", json.dumps(stale).encode())
    summary = run_pack(_cfg(raw, url, storage_options=opts))  # the killed job's lease expired: taken over
    assert summary.samples_read == 14
    fs.invalidate_cache()
    assert not fs.exists(f"leases/ds/{LOCK_NAME}") and fs.exists(f"leases/ds/{MARKER_NAME}")


def test_an_output_inside_an_input_folder_is_never_read_as_input(raw: Path, tmp_path: Path) -> None:
    import shutil

    data = tmp_path / "data"
    shutil.copytree(raw, data)
    out = data / "packed"
    runs = [run_pack(_cfg(data, out, format="both")) for _ in range(3)]
    # control: the output holds files an input folder scan would read (rejects.jsonl, .tar shards, work .jsonl)
    assert sum(is_input_file(p.name) for p in out.rglob("*")) >= 3
    assert [r.samples_read for r in runs] == [14, 14, 14]
    assert runs[1].stages_skipped == runs[2].stages_skipped == ["scan", "lengths", "binpack", "write"]
    first = dataset_files(out)
    other = tmp_path / "other"  # a second dataset packed into the input folder is skipped as well
    run_pack(_cfg(data, data / "second", work_dir=str(other)))
    assert run_pack(_cfg(data, out, format="both")).samples_read == 14 and dataset_files(out) == first
    with pytest.raises(ValueError, match="inside this job's output or work folder"):
        run_pack(_cfg(out / "rejects.jsonl", out))


def test_an_object_store_output_under_the_input_prefix_is_never_read_as_input(raw: Path, s3) -> None:
    opts = s3.storage_options
    data = s3.upload_folder(raw, "rawbkt", "data")
    first = run_pack(_cfg(data, f"{data}/packed", storage_options=opts, format="both"))
    second = run_pack(_cfg(data, f"{data}/packed", storage_options=opts, format="both"))
    assert first.samples_read == second.samples_read == 14
    assert second.stages_skipped == ["scan", "lengths", "binpack", "write"]
    fs = s3.filesystem()
    assert any(
        p.endswith((".jsonl", ".tar")) for p in fs.find("rawbkt/data/packed")
    )  # control: readable files


def test_a_refused_run_leaves_no_marker_in_an_input_folder_and_a_marked_folder_is_skipped_with_a_line(
    raw: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    parent = tmp_path / "parent"
    for name in ("a", "b"):
        shutil.copytree(raw, parent / name)
    record = next(p for p in sorted((parent / "a").rglob("*")) if is_input_file(p.name))
    with pytest.raises(ValueError, match="inside this job's output or work folder"):
        run_pack(_cfg(record, tmp_path / "out", work_dir=str(parent / "a"), overwrite=True))
    assert not has_marker(parent / "a") and not (tmp_path / "out").exists()  # no trace of the refused run
    assert run_pack(_cfg(parent, tmp_path / "out")).samples_read == 28  # both folders are read
    claim_folder(str(parent / "b"), "work", overwrite=True)  # now mmpack's: skipped, with a line saying so
    capsys.readouterr()
    assert run_pack(_cfg(parent, tmp_path / "out-2")).samples_read == 14
    assert (
        f"input file(s) under {parent / 'b'} skipped: it carries mmpack's marker {MARKER_NAME}"
        in capsys.readouterr().err
    )


def test_a_marked_object_store_prefix_is_skipped_with_the_same_line(
    raw: Path, s3, capsys: pytest.CaptureFixture[str]
) -> None:
    from mmpack.offline_packing.inputs.remote import RemoteFiles
    from mmpack.offline_packing.inputs.sources import expand_inputs

    opts = s3.storage_options
    parent = s3.upload_folder(raw, "rawbkt", "marked-parent/a").removesuffix("/a")
    s3.upload_folder(raw, "rawbkt", "marked-parent/b")
    capsys.readouterr()
    remote = RemoteFiles(opts)
    every = expand_inputs(remote, [parent])
    assert every and capsys.readouterr().err == ""  # control: nothing marked, both prefixes read, no line
    claim_folder(f"{parent}/b", "work", overwrite=True, storage_options=opts)
    kept = expand_inputs(remote, [parent])
    skipped = [f for f in every if f.startswith(f"{parent}/b/")]
    assert skipped and kept == [f for f in every if f not in skipped]
    assert (
        f"note: {len(skipped)} input file(s) under {parent}/b skipped: it carries mmpack's marker {MARKER_NAME}"
        in capsys.readouterr().err
    )


def test_the_refusal_of_a_users_output_says_what_overwrite_replaces(raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("the user's")
    with pytest.raises(FolderNotOwned) as refused:
        run_pack(_cfg(raw, out))
    message = str(refused.value)
    assert "nothing of yours is deleted or overwritten" not in message
    assert "or pass --overwrite to let mmpack write there (its manifest.json, stats.json, rejects" in message
    assert "replace yours of the same names; nothing else is touched)" in message
    (out / "notes.txt").write_text("the user's")
    run_pack(_cfg(raw, out, overwrite=True))  # following it does what it said
    assert (out / "manifest.json").read_text() != "the user's"
    assert (out / "notes.txt").read_text() == "the user's"
