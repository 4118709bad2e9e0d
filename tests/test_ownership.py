"""The ownership rule (`mmpack.packing.ownership`): a folder is written to or cleaned only with mmpack's marker."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mmpack.packing.errors import MmpackError
from mmpack.packing.joblock import LOCK_NAME, FolderLocked, LeaseConfig, hold_lock
from mmpack.packing.ownership import (
    MARKER_NAME,
    FolderNotOwned,
    claim_folder,
    has_marker,
    open_owned,
    read_marker,
)
from tests.support.storage_servers import moto_s3


def test_missing_or_empty_folder_is_created_and_marked(tmp_path: Path) -> None:
    new = claim_folder(str(tmp_path / "a" / "b"), "dataset")
    assert has_marker(tmp_path / "a" / "b") and new.marker["kind"] == "dataset"
    (tmp_path / "empty").mkdir()
    claim_folder(str(tmp_path / "empty"), "work")
    marker = json.loads((tmp_path / "empty" / MARKER_NAME).read_text())
    assert marker["kind"] == "work" and marker["creator"].startswith("mmpack ") and marker["pid"] > 0
    assert read_marker(str(tmp_path / "empty")) == marker


def test_same_kind_is_reused_other_kind_and_foreign_folders_refused(tmp_path: Path) -> None:
    claim_folder(str(tmp_path / "ds"), "dataset")
    (tmp_path / "ds" / "manifest.json").write_text("{}")
    again = claim_folder(str(tmp_path / "ds"), "dataset")  # a rerun: non-empty, but ours
    assert again.kind == "dataset"
    with pytest.raises(FolderNotOwned, match="mmpack's 'dataset' folder, not a 'work' one"):
        claim_folder(str(tmp_path / "ds"), "work", overwrite=True)
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(FolderNotOwned, match="not empty and was not made by mmpack") as info:
        claim_folder(str(user), "dataset", overwrite_flag="--overwrite", role="output (-o)")
    assert "\n" not in info.value.message and "--overwrite" in info.value.message
    assert info.value.reason == "folder_not_owned" and isinstance(info.value, MmpackError)
    assert not has_marker(user) and (user / "notes.txt").read_text() == "mine"
    claim_folder(str(user), "dataset", overwrite=True)  # adopted on request: marked, nothing else changed
    assert has_marker(user) and (user / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FolderNotOwned, match="is a file"):
        claim_folder(str(tmp_path / "file"), "dataset", overwrite=True)


def test_remove_recorded_deletes_only_listed_files_and_release_keeps_foreign_ones(tmp_path: Path) -> None:
    folder = claim_folder(str(tmp_path / "w"), "work")
    (tmp_path / "w" / "scan").mkdir()
    (tmp_path / "w" / "scan" / "chunk-0.json").write_text("1")
    (tmp_path / "w" / "scan" / "users.txt").write_text("2")
    (tmp_path / "w" / "lengths").mkdir()
    (tmp_path / "w" / "lengths" / "a.npy").write_text("3")
    assert folder.files() == ["lengths/a.npy", "scan/chunk-0.json", "scan/users.txt"]
    removed = folder.remove_recorded(["scan/chunk-0.json", "lengths/a.npy", "lengths/gone.npy"])
    assert removed == ["scan/chunk-0.json", "lengths/a.npy"]
    assert not (tmp_path / "w" / "lengths").exists()  # left empty: removed
    assert (tmp_path / "w" / "scan" / "users.txt").read_text() == "2"
    assert folder.release() is False and has_marker(tmp_path / "w")  # a file of someone else's is left
    folder.remove_recorded(["scan/users.txt"])
    assert folder.release() is True and not (tmp_path / "w").exists()
    for bad in ("../x", "/etc/passwd", "a/../../x", "", MARKER_NAME):
        with pytest.raises(ValueError):
            folder.remove_recorded([bad])


def test_open_owned_needs_the_marker_of_that_kind(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    with pytest.raises(FolderNotOwned, match="has no marker"):
        open_owned(str(tmp_path / "plain"), "work")
    claim_folder(str(tmp_path / "ds"), "dataset")
    with pytest.raises(FolderNotOwned, match="is marked 'dataset'"):
        open_owned(str(tmp_path / "ds"), "work")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / MARKER_NAME).write_text("not json")
    with pytest.raises(FolderNotOwned, match="not a marker mmpack wrote"):
        claim_folder(str(tmp_path / "bad"), "work")


def test_object_store_folders_follow_the_same_rule_and_a_bucket_is_never_deleted() -> None:
    with moto_s3() as s3:
        fs = s3.make_bucket("own")
        fs.pipe_file("own/user/data.bin", b"users")
        opts = s3.storage_options
        with pytest.raises(FolderNotOwned, match="not empty"):
            claim_folder("s3://own", "work", storage_options=opts)
        with pytest.raises(FolderNotOwned, match="not empty"):
            claim_folder("s3://own/user", "work", storage_options=opts)
        folder = claim_folder("s3://own/job/work", "work", storage_options=opts)
        fs.pipe_file("own/job/work/scan/c.json", b"1")
        fs.pipe_file("own/job/work/scan/keep.txt", b"2")
        assert claim_folder("s3://own/job/work", "work", storage_options=opts).files() == [
            "scan/c.json",
            "scan/keep.txt",
        ]
        assert folder.remove_recorded(["scan/c.json"]) == ["scan/c.json"]
        assert folder.release() is False
        folder.remove_recorded(["scan/keep.txt"])
        assert folder.release() is True
        fs.invalidate_cache()
        assert fs.exists("own") and fs.cat_file("own/user/data.bin") == b"users"
        assert not fs.exists(f"own/job/work/{MARKER_NAME}")


def test_local_lock_is_exclusive_names_its_holder_and_leaves_no_file(tmp_path: Path) -> None:
    with hold_lock(str(tmp_path), role="output (-o)", command="mmpack pack -o x"):
        holder = json.loads((tmp_path / LOCK_NAME).read_text())
        assert holder["pid"] == os.getpid() and holder["command"] == "mmpack pack -o x"
        with (
            pytest.raises(
                FolderLocked, match=rf"in use by another mmpack job: pid {os.getpid()} on .*mmpack pack -o x"
            ),
            hold_lock(str(tmp_path)),
        ):
            pass
    assert not (tmp_path / LOCK_NAME).exists()
    with hold_lock(str(tmp_path)):  # free again
        pass


def test_lease_of_a_dead_local_process_is_stale_and_a_lost_lease_is_noticed() -> None:
    import socket
    import subprocess
    import sys
    import time

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with moto_s3() as s3:
        fs = s3.make_bucket("leasebkt")
        opts = s3.storage_options
        dead = {
            "host": socket.gethostname(),
            "pid": gone.pid,
            "started": "x",
            "renewed": "2999-01-01T00:00:00Z",
        }
        fs.pipe_file(f"leasebkt/a/{LOCK_NAME}", json.dumps(dead).encode())
        with hold_lock("s3://leasebkt/a", storage_options=opts) as lock:
            assert lock.took_over == dead  # renewed "in the future", but its process is gone
        fast = LeaseConfig(ttl_s=30, renew_s=0.2)
        with hold_lock("s3://leasebkt/b", storage_options=opts, lease=fast) as lock:
            other = {"host": "elsewhere", "pid": 1, "started": "y", "renewed": "2999-01-01T00:00:00Z"}
            fs.pipe_file(f"leasebkt/b/{LOCK_NAME}", json.dumps(other).encode())  # taken by another job
            deadline = time.monotonic() + 20
            while lock.lost_to is None and time.monotonic() < deadline:
                time.sleep(0.1)
            with pytest.raises(FolderLocked, match="lease was taken over by pid 1 on elsewhere"):
                lock.check()
        fs.invalidate_cache()
        assert json.loads(fs.cat_file(f"leasebkt/b/{LOCK_NAME}")) == other  # the other job's lease is kept
