"""Shard readers refuse unsafe or malformed content instead of trusting it."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from dataloader.readers import WdsShardReader, open_shard_reader


def write_tar(path: Path, members: list[tuple[str, bytes]], *, symlink: str | None = None) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if symlink is not None:
            info = tarfile.TarInfo(symlink)
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tar.addfile(info)
    return path


def npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return buf.getvalue()


def good_bin(key: str, input_ids: np.ndarray | None = None) -> list[tuple[str, bytes]]:
    ids = np.arange(6, dtype=np.uint32) if input_ids is None else input_ids
    meta = {"key": key, "sample_ids": ["a", "b"], "image_formats": [], "n_images": 0}
    return [
        (f"{key}.json", json.dumps(meta).encode()),
        (f"{key}.input_ids.npy", npy(ids)),
        (f"{key}.loss_mask.npy", npy(np.ones(6, dtype=np.uint8))),
        (f"{key}.seq_lens.npy", npy(np.array([2, 4], dtype=np.int32))),
        (f"{key}.image_grid_thw.npy", npy(np.zeros((0, 3), dtype=np.int32))),
    ]


def test_wds_reader_reads_bins_in_tar_order(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "ok.tar", good_bin("p-000000000") + good_bin("p-000000001"))
    reader = open_shard_reader(str(path), "wds", label="shard ok.tar")
    assert len(reader) == 2
    rec = reader.read(1)
    assert rec["key"] == "p-000000001" and rec["sample_ids"] == ["a", "b"]
    assert rec["input_ids"].dtype == np.uint32 and rec["seq_lens"].tolist() == [2, 4]
    assert rec["image_grid_thw"].shape == (0, 3) and rec["images"] == []
    with pytest.raises(IndexError):
        reader.read(2)


@pytest.mark.parametrize("name", ["../evil.json", "/abs.json", "dir/key.json", "noext"])
def test_wds_reader_rejects_unsafe_member_names(tmp_path: Path, name: str) -> None:
    path = write_tar(tmp_path / "bad.tar", [*good_bin("p-000000000"), (name, b"{}")])
    with pytest.raises(ValueError, match=r"bad\.tar.*unexpected tar member"):
        WdsShardReader(str(path), label="shard bad.tar")


def test_wds_reader_rejects_links(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "link.tar", good_bin("p-000000000"), symlink="p-000000000.img0.jpg")
    with pytest.raises(ValueError, match="unexpected tar member"):
        WdsShardReader(str(path), label="shard link.tar")


def test_wds_reader_never_unpickles(tmp_path: Path) -> None:
    objects = np.array([{"x": 1}, None], dtype=object)  # saved with pickle inside the .npy
    path = write_tar(tmp_path / "pickle.tar", good_bin("p-000000000", input_ids=objects))
    reader = WdsShardReader(str(path), label="shard pickle.tar")
    with pytest.raises(ValueError, match="allow_pickle"):
        reader.read(0)


def test_wds_reader_names_missing_members(tmp_path: Path) -> None:
    members = [m for m in good_bin("p-000000000") if not m[0].endswith("loss_mask.npy")]
    reader = WdsShardReader(str(write_tar(tmp_path / "short.tar", members)), label="shard short.tar")
    with pytest.raises(ValueError, match=r"shard short\.tar: bin p-000000000 lacks member 'loss_mask\.npy'"):
        reader.read(0)
