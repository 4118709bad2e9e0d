"""Online packing (`mmpack.offline_packing.online`, `mmpack.dataloader.raw_source`): raw records packed buffer by
buffer in the loader give the offline job's bins, its fill, an exact resume and a counted, written reject."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmpack.dataloader import build_loader
from mmpack.dataloader.loader import PackedLoader
from mmpack.dataloader.manifest import load_manifest
from mmpack.dataloader.raw_source import RawAnchor, RawStream
from mmpack.dataloader.readers import open_shard_reader
from mmpack.dataloader.topology import Topology
from mmpack.demo.synthetic import make_synthetic_dataset, pack_synthetic
from mmpack.offline_packing.online import RawSource, raw_source

SEQ_LEN = 256
ONE_RANK = Topology(dp_rank=0, dp_size=1)


def _raw_of(packed: Path, buffer_size: int, seed: int, records: Path | None = None) -> RawSource:
    """The raw records a `packed_dataset` was packed from, as an online source with the same options."""
    raw = packed.parent / "raw"
    return raw_source(
        str(records or raw / "data.jsonl"),
        buffer_size=buffer_size,
        seq_len=SEQ_LEN,
        tokenizer=str(packed.parent / "tokenizer" / "tokenizer.json"),
        image_root=str(raw),
        seed=seed,
    )


def _offline_bins(packed: Path) -> list[dict[str, Any]]:
    manifest = load_manifest(str(packed))
    out = []
    for shard in manifest.shards:
        reader = open_shard_reader(str(packed / shard.path), shard.format, label=shard.path)
        out += [reader.read(j) for j in range(shard.bins)]
        reader.close()
    return out


def _online_bins(source: RawSource) -> list[dict[str, Any]]:
    return [
        packed.record(j)
        for packed in (source.pack_buffer(b) for b in range(source.num_buffers))
        for j in range(packed.num_bins)
    ]


def _contents(bins: list[dict[str, Any]]) -> list[tuple]:
    """Each bin as (its samples, token ids, loss mask, image bytes), sorted: what a bin holds, not where it is."""
    return sorted(
        (
            tuple(b["sample_ids"]),
            np.asarray(b["input_ids"], np.uint32).tobytes(),
            np.asarray(b["loss_mask"], np.uint8).tobytes(),
            tuple(bytes(i) for i in b["images"]),
        )
        for b in bins
    )


def _batch_contents(loader: PackedLoader, n: int) -> list[tuple[bytes, bytes, bytes]]:
    """(tokens, labels, pixels) of the first n micro-batches of one bin each, sorted."""
    out = []
    for _, batch in zip(range(n), loader):
        out.append(
            (
                batch.tokens.numpy().tobytes(),
                batch.labels.numpy().tobytes(),
                batch.pixel_values.numpy().tobytes(),
            )
        )
    return sorted(out)


def test_whole_dataset_buffer_gives_the_offline_bins(packed_dataset: Any) -> None:
    packed = packed_dataset(n_samples=60, seed=8)
    offline = _offline_bins(packed)
    source = _raw_of(packed, buffer_size=10_000, seed=8)
    assert source.num_buffers == 1
    assert _contents(_online_bins(source)) == _contents(offline)  # same samples, token ids, images
    # through the loaders: the same token rows, labels and pixel values, bin for bin
    n = len(offline)
    kw: dict[str, Any] = {
        "topology": ONE_RANK,
        "micro_batch_size": 1,
        "global_batch_size": 1,
        "num_workers": 0,
    }
    assert _batch_contents(build_loader(source, **kw), n) == _batch_contents(
        build_loader(str(packed), **kw), n
    )
    # control: a buffer of half the records packs other bins, and the comparison sees it
    halves = _raw_of(packed, buffer_size=30, seed=8)
    assert halves.num_buffers == 2
    assert _contents(_online_bins(halves)) != _contents(offline)


def test_buffer_of_a_twentieth_fills_within_a_point_of_the_offline_job(
    tmp_path: Path, packed_dataset: Any
) -> None:
    tokenizer = packed_dataset(n_samples=60, seed=8).parent / "tokenizer" / "tokenizer.json"
    data = make_synthetic_dataset(tmp_path / "raw", n_samples=4000, seed=3, formats=("text",), max_words=40)
    pack_synthetic(data, tokenizer, tmp_path / "packed", seq_len=SEQ_LEN, format="arrow")
    counts = load_manifest(str(tmp_path / "packed")).dataset.counts
    assert counts is not None
    offline_fill = counts.tokens / (counts.bins * SEQ_LEN)
    source = raw_source(str(data.jsonl_path), buffer_size=200, seq_len=SEQ_LEN, tokenizer=str(tokenizer))
    assert source.num_buffers == 20
    buffers = [source.pack_buffer(b) for b in range(source.num_buffers)]
    online_fill = sum(p.tokens for p in buffers) / (sum(p.num_bins for p in buffers) * SEQ_LEN)
    print(f"fill: offline {offline_fill:.4f}, online (buffer 1/20) {online_fill:.4f}")
    assert sum(p.tokens for p in buffers) == counts.tokens  # every sample packed, once
    assert offline_fill - online_fill < 0.01


def _stream(loader: PackedLoader, n: int) -> list[tuple[list[int], bytes]]:
    out = []
    for _, batch in zip(range(n), loader):
        assert batch.bin_ids is not None
        out.append((batch.bin_ids.tolist(), batch.tokens.numpy().tobytes()))
    return out


def test_resume_mid_epoch_equals_the_uninterrupted_stream(packed_dataset: Any) -> None:
    source = _raw_of(packed_dataset(n_samples=60, seed=8), buffer_size=15, seed=8)
    assert source.num_buffers == 4
    kw: dict[str, Any] = {
        "topology": ONE_RANK,
        "micro_batch_size": 2,
        "global_batch_size": 4,
        "num_workers": 0,
    }
    whole = _stream(build_loader(source, **kw, seed=3), 16)  # into the second epoch
    assert whole == _stream(build_loader(source, **kw, seed=3), 16)  # a pure function of (seed, positions)
    for cut in (4, 5):  # between steps, and one micro-batch into a step
        first = build_loader(source, **kw, seed=3)
        assert _stream(first, cut) == whole[:cut]
        state = first.state_dict()
        assert len(json.dumps(state)) < 1024 and state["kind"] == "raw"  # positions, not samples
        resumed = build_loader(source, **kw, seed=3)
        resumed.load_state_dict(json.loads(json.dumps(state)))
        assert _stream(resumed, 16 - cut) == whole[cut:]
    # a state saved between steps resumes with another DP size: rank r's micro-batch is half of each step
    saver = build_loader(source, **kw, seed=3)
    _stream(saver, 4)
    halves = []
    for rank in range(2):
        loader = build_loader(source, **{**kw, "topology": Topology(dp_rank=rank, dp_size=2)}, seed=3)
        loader.load_state_dict(saver.state_dict())
        halves.append(_stream(loader, 6))
    assert [x for pair in zip(*halves) for x in pair] == whole[4:16]
    # control: another seed orders other bins, and a state of it is refused
    other = build_loader(source, **kw, seed=4)
    assert _stream(other, 16) != whole
    with pytest.raises(ValueError, match="seed"):
        build_loader(source, **kw, seed=3).load_state_dict(other.state_dict())


def test_malformed_record_is_skipped_counted_and_written(tmp_path: Path, packed_dataset: Any) -> None:
    packed = packed_dataset(n_samples=60, seed=8)
    lines = (packed.parent / "raw" / "data.jsonl").read_text().splitlines(keepends=True)
    records = tmp_path / "with-bad.jsonl"
    records.write_text("".join(lines[:30]) + '{"conversations": [oops\n' + "".join(lines[30:]))
    source = _raw_of(packed, buffer_size=20, seed=8, records=records)
    rejects = tmp_path / "rejects"
    loader = build_loader(
        source,
        topology=ONE_RANK,
        micro_batch_size=1,
        global_batch_size=1,
        num_workers=2,
        rejects_dir=str(rejects),
    )
    buffers = [source.pack_buffer(b) for b in range(source.num_buffers)]
    bins = sum(p.num_bins for p in buffers)
    # one epoch, read on past the reject, and a few batches more: each worker has passed every buffer since
    read = len([batch for _, batch in zip(range(bins + 4), loader)])
    assert read == bins + 4
    samples = sum(len(members) for p in buffers for members in p.bins)
    metrics = loader.metrics()
    loader.close()
    rows = [json.loads(x) for x in (rejects / "rejects-dp0.jsonl").read_text().splitlines()]
    bad = [r for r in rows if r["reason"] == "malformed_json"]
    assert [(Path(r["source"]).name, r["line"]) for r in bad] == [("with-bad.jsonl", 31)]
    assert metrics["raw_rejected.malformed_json"] == 1
    assert metrics["raw_samples_read"] == 61 and metrics["raw_samples_rejected"] == len(rows)
    assert samples == 61 - len(rows)  # the rest goes on: every other record is trained on


def test_compute_balance_lays_out_each_global_batch_over_ranks(packed_dataset: Any) -> None:
    source = _raw_of(packed_dataset(n_samples=60, seed=8), buffer_size=30, seed=8)
    kw: dict[str, Any] = {"micro_batch_size": 1, "global_batch_size": 4, "num_workers": 0}
    plain = _stream(build_loader(source, topology=ONE_RANK, **kw), 8)  # 2 global batches, in stream order
    ranks = [
        _stream(build_loader(source, topology=Topology(dp_rank=r, dp_size=2), balance="compute", **kw), 4)
        for r in range(2)
    ]
    for step in range(2):
        global_bins = sorted(b for ids, _ in plain[4 * step : 4 * step + 4] for b in ids)
        mine = [b for rank in ranks for ids, _ in rank[2 * step : 2 * step + 2] for b in ids]
        assert sorted(mine) == global_bins  # the same bins, each on one rank
    assert [ids for rank in ranks for ids, _ in rank] != [ids for ids, _ in plain]  # laid out by cost


def test_stream_walk_passes_empty_buffers_and_continues_from_any_anchor() -> None:
    counts = {0: 0, 1: 3, 2: 0, 3: 2}  # buffers 0 and 2: every record rejected
    whole = RawStream(4, 1, RawAnchor(), counts.__getitem__).positions(0, 25)
    assert sorted(set(whole.tolist())) == [(1 << 32) | j for j in range(3)] + [
        (3 << 32) | j for j in range(2)
    ]
    for p in range(20):
        anchor = RawStream(4, 1, RawAnchor(), counts.__getitem__).locate(p)
        assert (RawStream(4, 1, anchor, counts.__getitem__).positions(p, 5) == whole[p : p + 5]).all()
    with pytest.raises(ValueError, match="has 0 bins"):  # control: a state the records do not match
        RawStream(4, 1, RawAnchor(position=7, epoch=1, slot=0, offset=1), counts.__getitem__)
    with pytest.raises(ValueError, match="every record"):
        RawStream(4, 1, RawAnchor(), lambda b: 0)


def _pack_all(source: RawSource, order: list[int]) -> dict[int, tuple[int, list[tuple]]]:
    """Each buffer's (packing process, bin contents), packed in `order` (run in a forked loader-like process)."""
    out = {}
    for b in order:
        packed = source.pack_buffer(b)
        out[b] = (packed.packed_by, _contents([packed.record(j) for j in range(packed.num_bins)]))
    return out


@pytest.mark.parametrize("cached", [True, False])
def test_packing_cache_packs_each_buffer_once_for_all_processes(
    tmp_path: Path, packed_dataset: Any, cached: bool
) -> None:
    import dataclasses
    import multiprocessing

    packed = packed_dataset(n_samples=60, seed=8)
    plain = _raw_of(packed, buffer_size=10, seed=8)
    source = dataclasses.replace(plain, cache=str(tmp_path / "cache") if cached else None)
    n = source.num_buffers
    assert n == 6
    orders = [list(range(n)), list(range(n))[::-1], [*range(3, n), *range(3)], [1, 0, 3, 2, 5, 4]]
    with multiprocessing.get_context("fork").Pool(4) as pool:  # 2 DP ranks x 2 workers on one node
        seen = pool.starmap(_pack_all, [(source, order) for order in orders])
    expected = _pack_all(plain, list(range(n)))
    for b in range(n):
        packers = {s[b][0] for s in seen}
        # with the cache one process packed each buffer, the others read its plan; without, each packed it
        assert len(packers) == (1 if cached else 4), (b, packers)
        assert all(s[b][1] == expected[b][1] for s in seen)  # the stream equals the uncached one
    if cached:
        assert len(list((tmp_path / "cache" / source.fingerprint).glob("*.plan"))) == n
        assert not list((tmp_path / "cache").rglob("*.claim"))
        # a source of another fingerprint (another seed) does not read these plans
        other = dataclasses.replace(_raw_of(packed, buffer_size=10, seed=9), cache=str(tmp_path / "cache"))
        assert other.fingerprint != source.fingerprint
        assert _pack_all(other, [0])[0][0] == os.getpid()  # packed here, not read
        assert _pack_all(other, [0])[0][1] == _pack_all(dataclasses.replace(other, cache=None), [0])[0][1]


def test_packing_cache_takes_over_a_claim_left_by_a_dead_process(tmp_path: Path, packed_dataset: Any) -> None:
    import dataclasses
    import socket
    import subprocess
    import sys

    source = dataclasses.replace(
        _raw_of(packed_dataset(n_samples=60, seed=8), buffer_size=30, seed=8), cache=str(tmp_path)
    )
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / source.fingerprint
    folder.mkdir()
    (folder / "buffer-000001.claim").write_text(f"{socket.gethostname()} {dead.pid} 0")
    assert source.pack_buffer(1).packed_by == os.getpid()  # taken over, not waited for
    # a claim of a live process on another host is taken over after the claim timeout
    (folder / "buffer-000000.claim").write_text(f"elsewhere {os.getpid()} 0")
    old = os.path.getmtime(folder / "buffer-000000.claim") - 10
    os.utime(folder / "buffer-000000.claim", (old, old))
    assert dataclasses.replace(source, claim_timeout=5.0).pack_buffer(0).packed_by == os.getpid()
    assert sorted(p.name for p in folder.iterdir()) == ["buffer-000000.plan", "buffer-000001.plan"]


def test_loader_workers_of_two_ranks_pack_each_buffer_once(
    tmp_path: Path, packed_dataset: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    counter = tmp_path / "packed.txt"
    pack = RawSource._pack

    def counted(self: RawSource, buffer: int) -> Any:  # one line per packing, by any process (workers fork)
        with open(counter, "a") as fh:
            fh.write(f"{self.fingerprint[:8]} {buffer}\n")
        return pack(self, buffer)

    monkeypatch.setattr(RawSource, "_pack", counted)
    plain = _raw_of(packed_dataset(n_samples=60, seed=8), buffer_size=15, seed=8)
    kw: dict[str, Any] = {"micro_batch_size": 1, "global_batch_size": 2, "seed": 3}
    streams = {}
    for cache in (None, str(tmp_path / "cache")):
        counter.write_text("")
        source = dataclasses.replace(plain, cache=cache)
        for rank in range(2):  # 2 DP ranks x 2 loader workers, each rank's loader walks the whole epoch
            loader = build_loader(source, topology=Topology(dp_rank=rank, dp_size=2), num_workers=2, **kw)
            streams[cache, rank] = _stream(loader, 12)
            loader.close()
        lines = counter.read_text().splitlines()
        if cache is None:  # control: without the cache the ranks' workers pack the buffers again and again
            assert len(lines) > source.num_buffers
        else:
            assert sorted(lines) == sorted(set(lines)) and len(lines) == source.num_buffers
    assert streams[None, 0] == streams[str(tmp_path / "cache"), 0]
    assert streams[None, 1] == streams[str(tmp_path / "cache"), 1]


def _packed_ids(source: RawSource) -> tuple[list[str], list[tuple[str, int]], int]:
    """(ids of the samples packed, (file, line) of the records rejected, records read) over every buffer."""
    ids: list[str] = []
    rejects: list[tuple[str, int]] = []
    read = 0
    for b in range(source.num_buffers):
        packed = source.pack_buffer(b)
        ids += [str(i) for j in range(packed.num_bins) for i in packed.record(j)["sample_ids"]]
        rejects += [(Path(r["source"]).name, r["line"]) for r in packed.rejects]
        read += packed.samples_read
    return ids, rejects, read


def test_split_divides_the_records_before_packing(packed_dataset: Any) -> None:
    """--split over raw records: the parts are disjoint and together every record (packed or rejected), a
    record's part does not depend on the buffer size, and the loader of a part streams, states and resumes as
    an unsplit one. Control: another split seed divides the records otherwise."""
    from mmpack.dataloader.order import BinSplit

    packed = packed_dataset(n_samples=60, seed=8)
    source = _raw_of(packed, buffer_size=15, seed=8)
    weights = (70.0, 20.0, 10.0)
    all_ids, all_rejects, all_read = _packed_ids(source)
    parts = [_packed_ids(source.split_records(BinSplit(weights, k, 5))) for k in range(3)]
    ids = [set(p[0]) for p in parts]
    assert all(len(p[0]) == len(set(p[0])) for p in parts)
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])  # disjoint
    assert sorted(i for p in parts for i in p[0]) == sorted(all_ids)  # together every packed sample, once
    assert sorted(r for p in parts for r in p[1]) == sorted(all_rejects)
    assert sum(p[2] for p in parts) == all_read == 60
    assert [p[2] for p in parts] == [41, 14, 5]  # about 70/20/10 of the 60 records (a hash per record)
    # a record's part is its own: a buffer of the whole input packs the same records in the valid part
    whole = _raw_of(packed, buffer_size=10_000, seed=8).split_records(BinSplit(weights, 1, 5))
    assert sorted(_packed_ids(whole)[0]) == sorted(parts[1][0])
    # control: another split seed, another division
    assert set(_packed_ids(source.split_records(BinSplit(weights, 1, 6)))[0]) != ids[1]
    # the loader of the valid part reads only its records and resumes exactly
    kw: dict[str, Any] = {
        "topology": ONE_RANK,
        "micro_batch_size": 1,
        "global_batch_size": 2,
        "num_workers": 0,
    }
    valid = source.split_records(BinSplit(weights, 1, 5))
    stream = _stream(build_loader(source, **kw, seed=3, split=(weights, 1, 5)), 8)
    seen = {
        str(i)
        for bin_ids, _ in stream
        for b in bin_ids
        for i in valid.pack_buffer(b >> 32).record(b & 0xFFFFFFFF)["sample_ids"]
    }
    assert seen <= ids[1]
    first = build_loader(source, **kw, seed=3, split=(weights, 1, 5))
    assert _stream(first, 3) == stream[:3]
    state = first.state_dict()
    assert state["split"] == "70,20,10:valid"
    resumed = build_loader(source, **kw, seed=3, split=(weights, 1, 5))
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert _stream(resumed, 5) == stream[3:]
    with pytest.raises(ValueError, match="split"):  # a state of the train part does not resume the valid one
        build_loader(source, **kw, seed=3, split=(weights, 0, 5)).load_state_dict(state)
    with pytest.raises(ValueError, match="leaves no record in that part"):
        build_loader(source, **kw, split=((1.0, 0.0, 0.0), 1, 5))
