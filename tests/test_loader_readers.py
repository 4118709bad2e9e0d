"""Shard readers refuse unsafe or malformed content instead of trusting it."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mmpack.dataloader.readers import (
    WdsShardReader,
    decode_npy,
    decode_wds_bin,
    index_tar,
    open_shard_reader,
    walk_plain_tar,
)


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


# --- fast tar index and .npy decoder: same view as tarfile / np.load, damage named by shard ------------------


def tarfile_view(path: Path) -> list[tuple[str, int, int]]:
    with tarfile.open(path, "r:") as tar:
        return [(m.name, m.offset_data, m.size) for m in tar]


def fast_view(path: Path) -> list[tuple[str, int, int]] | None:
    """The direct header walk alone (None: it hands the archive to tarfile)."""
    data = path.read_bytes()
    return walk_plain_tar(data, label=str(path))


def write_formatted_tar(path: Path, members: list[tuple[str, bytes]], fmt: int, **kw: Any) -> Path:
    with tarfile.open(path, "w", format=fmt, **kw) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return path


LONG_KEY = "a-very-long-prefix-" * 6 + "000000007"  # members' names exceed the 100 bytes of a ustar name


def varied_bins(key_b: str) -> list[tuple[str, bytes]]:
    """Two bins with members of sizes 0, exact block multiples and odd sizes, plus an image."""
    return [
        *good_bin("p-000000000", np.arange(128, dtype=np.uint32)),  # npy of exactly 640 bytes
        ("p-000000000.img0.jpg", b""),
        ("p-000000000.img1.png", bytes(range(256)) * 2),
        *good_bin(key_b, np.arange(1000, dtype=np.uint32)),
    ]


@pytest.mark.parametrize(
    ("fmt", "key_b"),
    [
        (tarfile.USTAR_FORMAT, "p-000000001"),
        (tarfile.GNU_FORMAT, "p-000000001"),
        (tarfile.GNU_FORMAT, LONG_KEY),
        (tarfile.PAX_FORMAT, "p-000000001"),
        (tarfile.PAX_FORMAT, LONG_KEY),
    ],
)
def test_fast_index_equals_tarfile_view(tmp_path: Path, fmt: int, key_b: str) -> None:
    path = write_formatted_tar(tmp_path / "s.tar", varied_bins(key_b), fmt)
    expected = tarfile_view(path)
    assert len(expected) == 12 and any(len(name) > 100 for name, _, _ in expected) == (key_b == LONG_KEY)
    assert fast_view(path) == expected  # walked directly, not handed to tarfile
    with open(path, "rb") as fh:
        assert index_tar(fh, label="s") == expected
    reader = WdsShardReader(str(path), label="shard s.tar")
    rec = reader.read(1)
    assert rec["key"] == key_b and rec["input_ids"].tolist() == list(range(1000))
    assert reader.read(0)["images"] == [b"", bytes(range(256)) * 2]
    reader.close()


def test_fast_index_reads_pax_records_it_knows_and_hands_over_the_rest(tmp_path: Path) -> None:
    members = varied_bins(LONG_KEY)
    plain = write_formatted_tar(tmp_path / "plain.tar", members, tarfile.PAX_FORMAT, pax_headers={})
    with tarfile.open(tmp_path / "extra.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for i, (name, data) in enumerate(members):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = (
                len(data),
                1.5 + i,
            )  # float mtime and a comment: pax records without effect
            info.pax_headers = {"comment": "made by a test"}
            tar.addfile(info, io.BytesIO(data))
    glob = write_formatted_tar(
        tmp_path / "g.tar", members, tarfile.PAX_FORMAT, pax_headers={"note": "global"}
    )
    for path in (plain, tmp_path / "extra.tar"):
        assert fast_view(path) == tarfile_view(path)
    assert fast_view(glob) is None  # a global header: tarfile indexes it
    with open(glob, "rb") as fh:
        assert index_tar(fh, label="g") == tarfile_view(glob)


def test_wds_reader_rejects_directories(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "dir.tar", good_bin("p-000000000"))
    with tarfile.open(path, "a") as tar:
        info = tarfile.TarInfo("p-000000001.json")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    with pytest.raises(ValueError, match=r"dir\.tar.*unexpected tar member 'p-000000001\.json'"):
        WdsShardReader(str(path), label="shard dir.tar")


def test_bad_header_checksum_names_the_shard(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "ok.tar", good_bin("p-000000000"))
    offsets = [offset - 512 for _, offset, _ in tarfile_view(path)]
    for header in (
        offsets[0],
        offsets[3],
    ):  # the first header (tarfile: an error) or a later one (tarfile: EOF)
        data = bytearray(path.read_bytes())
        data[header + 5] ^= 0x01  # a byte of the member name
        bad = tmp_path / "bad.tar"
        bad.write_bytes(bytes(data))
        with pytest.raises(ValueError, match=rf"shard bad\.tar: bad tar header checksum at offset {header}"):
            WdsShardReader(str(bad), label="shard bad.tar")


def test_truncated_archive_names_the_shard(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "ok.tar", good_bin("p-000000000"))
    view = tarfile_view(path)
    _, last_data, last_size = view[-1]
    cuts = [
        view[1][1] + 10,
        view[2][1] - 300,
        last_data + last_size,
        0,
    ]  # in data, in a header, before the end
    for cut in cuts:
        short = tmp_path / "short.tar"
        short.write_bytes(path.read_bytes()[:cut])
        with pytest.raises(ValueError, match=r"shard short\.tar: (truncated tar|empty file)"):
            WdsShardReader(str(short), label="shard short.tar")


def test_truncated_npy_member_names_the_shard(tmp_path: Path) -> None:
    members = good_bin("p-000000000", np.arange(100, dtype=np.uint32))
    members = [(n, d[:-7] if n.endswith("input_ids.npy") else d) for n, d in members]
    reader = WdsShardReader(str(write_tar(tmp_path / "npy.tar", members)), label="shard npy.tar")
    with pytest.raises(
        ValueError, match=r"shard npy\.tar: bin p-000000000 member 'input_ids\.npy': truncated"
    ):
        reader.read(0)
    with pytest.raises(ValueError):
        np.load(io.BytesIO(members[1][1]), allow_pickle=False)  # np.load refuses it too
    reader.close()


def test_records_outlive_the_reader_and_are_writable(tmp_path: Path) -> None:
    reader = WdsShardReader(str(write_tar(tmp_path / "ok.tar", good_bin("p-000000000"))), label="s")
    rec = reader.read(0)
    reader.close()
    rec["input_ids"][0] = 7  # np.load gave writable arrays of their own; so does the fast decoder
    assert rec["input_ids"].tolist() == [7, 1, 2, 3, 4, 5] and rec["loss_mask"].flags.owndata


NPY_DTYPES = [
    "?",
    "i1",
    "u1",
    "<i2",
    "<u2",
    "<i4",
    "<u4",
    "<i8",
    "<u8",
    "<f2",
    "<f4",
    "<f8",
    ">u4",
    ">f8",
    "<c8",
]


@settings(max_examples=150, deadline=None)
@given(
    arr=st.sampled_from(NPY_DTYPES).flatmap(
        lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    ),
    fortran=st.booleans(),
    version=st.sampled_from([None, (1, 0), (2, 0), (3, 0)]),
)
def test_decode_npy_equals_np_load(arr: np.ndarray, fortran: bool, version: tuple[int, int] | None) -> None:
    arr = np.asfortranarray(arr) if fortran else arr
    buf = io.BytesIO()
    if version is None:
        np.save(buf, arr)
    else:
        np.lib.format.write_array(buf, arr, version=version)
    expected = np.load(io.BytesIO(buf.getvalue()), allow_pickle=False)
    got = decode_npy(memoryview(buf.getvalue()))
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    assert got.flags.writeable and got.tobytes() == expected.tobytes()


def test_plain_members_skip_np_load_and_a_bin_is_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_tar(tmp_path / "ok.tar", good_bin("p-000000000") + good_bin("p-000000001"))
    reader = WdsShardReader(str(path), label="s")
    reads: list[int] = []
    pread = os.pread

    def counting_pread(fd: int, n: int, offset: int) -> bytes:
        reads.append(offset)
        return pread(fd, n, offset)

    def no_np_load(*args: Any, **kw: Any) -> Any:
        raise AssertionError("np.load used for a plain .npy member")

    monkeypatch.setattr(os, "pread", counting_pread)
    monkeypatch.setattr(np, "load", no_np_load)
    assert reader.read(1)["seq_lens"].tolist() == [2, 4] and reader.read(0)["key"] == "p-000000000"
    assert len(reads) == 2
    reader.close()


def test_extension_header_without_its_member_is_refused(tmp_path: Path) -> None:
    path = write_formatted_tar(tmp_path / "pax.tar", good_bin(LONG_KEY), tarfile.PAX_FORMAT)
    first_data = tarfile_view(path)[0][1]  # the pax header and its records come before this member's header
    cut = tmp_path / "cut.tar"
    cut.write_bytes(path.read_bytes()[: first_data - 512] + bytes(1024))
    with pytest.raises(ValueError, match=r"shard cut\.tar: unreadable tar archive"):
        WdsShardReader(str(cut), label="shard cut.tar")


def test_signed_header_checksum_is_accepted_like_tarfile(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "ok.tar", good_bin("p-000000000"))
    data = bytearray(path.read_bytes())
    data[265] = 0xE9  # first byte of the uname field, so the signed and unsigned sums differ
    header = bytes(data[:148]) + b" " * 8 + bytes(data[156:512])
    signed = sum(b - 256 if b > 127 else b for b in header)
    data[148:156] = b"%06o\0 " % signed
    path.write_bytes(bytes(data))
    assert fast_view(path) == tarfile_view(path) and len(tarfile_view(path)) == 5


def test_decode_wds_bin_takes_a_webdataset_sample_of_bytes() -> None:
    sample = {name.split(".", 1)[1]: data for name, data in good_bin("p-000000003")}
    sample["img0.jpg"] = b"\xff\xd8jpeg"
    rec = decode_wds_bin("p-000000003", sample, sample.__getitem__, label="s")
    assert rec["input_ids"].tolist() == list(range(6)) and rec["loss_mask"].dtype == np.uint8
    assert rec["images"] == [b"\xff\xd8jpeg"] and rec["image_grid_thw"].shape == (0, 3)


def _same_records(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key, value in x.items():
            if isinstance(value, np.ndarray):
                np.testing.assert_array_equal(value, y[key])
            else:
                assert value == y[key], key


def test_wds_index_is_shared_through_its_cache_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mmpack.dataloader.readers.tar_index as readers

    shard = write_tar(tmp_path / "s.tar", good_bin("000001") + good_bin("000002", np.arange(6, 12)))
    cache = tmp_path / "meta" / "digest.tar-index.json"
    first = WdsShardReader(str(shard), label="s", index_cache=str(cache))
    want = [first.read(i) for i in range(len(first))]
    first.close()
    assert json.loads(cache.read_text())["file_size"] == shard.stat().st_size

    walks: list[str] = []
    real_index = readers.index_tar

    def counting_index(fh: Any, *, label: str) -> Any:
        walks.append(label)
        return real_index(fh, label=label)

    monkeypatch.setattr(readers, "index_tar", counting_index)
    second = WdsShardReader(str(shard), label="s", index_cache=str(cache))
    _same_records(want, [second.read(i) for i in range(len(second))])
    second.close()
    assert walks == []  # loaded, not walked

    # A damaged cache file, or one made for other content (another size), is ignored and rewritten.
    for damage in ("{not json", json.dumps({**json.loads(cache.read_text()), "file_size": 1})):
        cache.write_text(damage)
        third = WdsShardReader(str(shard), label="s", index_cache=str(cache))
        _same_records(want, [third.read(i) for i in range(len(third))])
        third.close()
        assert json.loads(cache.read_text())["file_size"] == shard.stat().st_size
    assert walks == ["s", "s"]


@pytest.mark.parametrize(
    ("fmt", "key"),
    [(tarfile.USTAR_FORMAT, "p-000000001"), (tarfile.GNU_FORMAT, LONG_KEY), (tarfile.PAX_FORMAT, LONG_KEY)],
)
def test_index_of_a_file_object_without_a_descriptor_equals_the_mapped_one(
    tmp_path: Path, fmt: int, key: str
) -> None:
    """The walker reads remote objects (no fileno, no mmap) by seeking: same entries as from a local file."""
    path = write_formatted_tar(tmp_path / "s.tar", varied_bins(key), fmt)
    expected = tarfile_view(path)
    with open(path, "rb") as fh:
        assert index_tar(fh, label="s") == expected
    assert index_tar(io.BytesIO(path.read_bytes()), label="s") == expected
    with pytest.raises(ValueError, match="s: truncated tar"):
        index_tar(io.BytesIO(path.read_bytes()[:1536]), label="s")


def test_non_regular_members_raise_for_shards_and_are_skipped_for_raw_input(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "l.tar", [("a.json", b"{}"), ("a.jpg", b"x")], symlink="a.link")
    with open(path, "rb") as fh, pytest.raises(ValueError, match=r"unexpected tar member 'a\.link'"):
        index_tar(fh, label="l")
    with open(path, "rb") as fh:
        assert [name for name, _, _ in index_tar(fh, label="l", non_regular="skip")] == ["a.json", "a.jpg"]


def test_wds_index_cache_of_another_version_or_with_members_outside_their_bin_is_redone(
    tmp_path: Path,
) -> None:
    """A cache file in the old flat layout (version 1), one whose member lies outside its bin's span, or one
    whose numbers or members have another shape, is ignored: the tar is walked again and the file rewritten;
    the records read are the same."""
    shard = write_tar(tmp_path / "s.tar", good_bin("000001") + good_bin("000002", np.arange(6, 12)))
    cache = tmp_path / "meta" / "digest.tar-index.json"
    first = WdsShardReader(str(shard), label="s", index_cache=str(cache))
    want = [first.read(i) for i in range(len(first))]
    first.close()
    good = json.loads(cache.read_text())
    assert good["version"] == 2 and [b[0] for b in good["bins"]] == ["000001", "000002"]
    with open(shard, "rb") as fh:
        flat = {"version": 1, "file_size": good["file_size"], "entries": index_tar(fh, label="s")}
    outside = json.loads(cache.read_text())
    _key, _start, end, members = outside["bins"][0]
    suffix = next(iter(members))
    members[suffix] = [end, 1]  # past the bin's span
    # numbers that are not ints, members not as [offset, size]: the cache is used as JSON gives it, so
    # each shape is checked on load
    not_int, three, listed = (json.loads(cache.read_text()) for _ in range(3))
    not_int["bins"][1][3][suffix][1] = float(not_int["bins"][1][3][suffix][1])  # e.g. 128.0
    three["bins"][0][3][suffix].append(0)
    listed["bins"][1][3] = list(listed["bins"][1][3].items())
    for damaged in (flat, outside, not_int, three, listed):
        cache.write_text(json.dumps(damaged))
        again = WdsShardReader(str(shard), label="s", index_cache=str(cache))
        _same_records(want, [again.read(i) for i in range(len(again))])
        again.close()
        assert json.loads(cache.read_text()) == good
