"""How loader workers hand batches over: several small micro-batches per message, room kept back while batches
are large, and local shards read ahead without a thread (mmpack.dataloader.worker, mmpack.dataloader.pool)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmpack.dataloader import Topology, build_loader, load_manifest
from mmpack.dataloader import worker as worker_mod
from mmpack.dataloader.storage import StorageConfig
from mmpack.dataloader.transport import MAX_SLOTS, SlotReader
from mmpack.dataloader.worker import LocalReadAhead, Producer, ProducerSpec, worker_loop
from mmpack.demo.synthetic import build_packed_dataset
from tests.support.loader_data import assert_same


def batches(loader: Any) -> list[dict[str, Any]]:
    out = list(loader)
    assert all(b is not None for b in out)
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed_dataset(tmp_path_factory.mktemp("handover"), fmt="wds", max_bins_per_shard=3)


def _spec(dataset: Path, **kw: Any) -> ProducerSpec:
    ld = build_loader(
        str(dataset), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=2, global_batch_size=2, **kw
    )
    spec = ld.spec
    ld.close()
    return spec


class RecordingPipe:
    """Stands in for the worker's pipe: keeps every message sent."""

    def __init__(self) -> None:
        self.messages: list[list[tuple[str, int, Any, dict[str, int]]]] = []
        self.sent = threading.Event()

    def send(self, msg: list[tuple[str, int, Any, dict[str, int]]]) -> None:
        self.messages.append(msg)
        self.sent.set()

    def close(self) -> None:
        pass


def _run_worker(spec: ProducerSpec, k_end: int, handover: int, room: int) -> tuple[RecordingPipe, Any, Any]:
    """worker_loop in a thread, making micro-batches 0..k_end-1 with `room` batches of room and nobody
    taking them; returns once it waits for room or is done (the caller stops it)."""
    pipe = RecordingPipe()
    ahead, stop = threading.Semaphore(room), threading.Event()
    flags = mp.get_context("fork").RawArray("B", MAX_SLOTS)
    t = threading.Thread(
        target=worker_loop, args=(spec, 0, 1, 0, k_end, pipe, flags, ahead, stop, handover), daemon=True
    )
    t.start()
    return pipe, (t, stop), (flags, ahead)


def _wait_quiet(pipe: RecordingPipe, expected: int) -> None:
    """Waits until `expected` batches have been sent."""
    for _ in range(600):
        if sum(len(m) for m in pipe.messages) >= expected:
            return
        pipe.sent.wait(0.05)
        pipe.sent.clear()
    raise AssertionError(f"only {sum(len(m) for m in pipe.messages)} of {expected} batches were sent")


def _stop(handle: tuple[threading.Thread, threading.Event]) -> None:
    t, stop = handle
    stop.set()
    t.join(10)
    assert not t.is_alive()


@pytest.mark.parametrize("handover", [1, 4])
def test_small_batches_travel_several_per_message_in_order(dataset: Path, handover: int) -> None:
    spec = _spec(dataset)
    n = 11
    pipe, handle, (flags, ahead) = _run_worker(spec, n, handover, room=100)
    try:
        _wait_quiet(pipe, n)
    finally:
        _stop(handle)
    sizes = [len(m) for m in pipe.messages]
    # the first batch alone (time to first batch), then full groups, then what is left at the end
    assert sizes == [1] + [handover] * ((n - 1) // handover) + (
        [(n - 1) % handover] if (n - 1) % handover else []
    )
    items = [item for m in pipe.messages for item in m]
    assert [k for _, k, _, _ in items] == list(range(n)) and {kind for kind, _, _, _ in items} == {"ok"}
    # the batches are those the producer makes one at a time
    reader = SlotReader(flags, ahead)
    producer = Producer(dataclasses.replace(spec, prefetch_shards=0), 0, n)
    try:
        for _, k, msg, _ in items:
            got, want = reader.take(msg), dict(producer.produce(k).items())
            assert list(got) == list(want)
            for key, value in want.items():
                if isinstance(value, np.ndarray):
                    np.testing.assert_array_equal(got[key].numpy(), value, err_msg=key)
                else:
                    assert got[key] == value, key
    finally:
        producer.close()


def test_large_batches_keep_the_handover_room_back(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody takes batches: small ones fill prefetch + handover of room, large ones only prefetch."""
    spec = _spec(dataset)
    prefetch, handover = 2, 3
    made = {}
    for label, limit in (("small", 1 << 40), ("large", 1)):
        monkeypatch.setattr(worker_mod, "HANDOVER_MAX_BYTES", limit)
        pipe, handle, _ = _run_worker(spec, 40, handover, room=prefetch + handover)
        try:
            # every batch made is sent before the worker waits for room, so the count settles
            _wait_quiet(pipe, prefetch if label == "large" else prefetch + handover)
            threading.Event().wait(0.5)  # a worker that went on would have sent more by now
            made[label] = sum(len(m) for m in pipe.messages)
            if label == "large":
                assert all(len(m) == 1 for m in pipe.messages)
        finally:
            _stop(handle)
    assert made == {"small": prefetch + handover, "large": prefetch}


def test_handover_sizes_give_the_same_stream(dataset: Path) -> None:
    kw: dict[str, Any] = {"micro_batch_size": 2, "global_batch_size": 4, "seed": 5, "num_epochs": 1}
    topo = Topology(dp_rank=0, dp_size=1)
    one = batches(build_loader(str(dataset), topology=topo, num_workers=2, handover_batches=1, **kw))
    several = batches(build_loader(str(dataset), topology=topo, num_workers=2, handover_batches=4, **kw))
    assert_same(one, several)
    # control: the comparison sees a different stream
    other = batches(
        build_loader(str(dataset), topology=topo, num_workers=2, handover_batches=4, **(kw | {"seed": 6}))
    )
    with pytest.raises(AssertionError):
        assert_same(one, other)


def test_resume_inside_a_step_with_several_per_message(dataset: Path) -> None:
    kw: dict[str, Any] = {"micro_batch_size": 1, "global_batch_size": 4, "seed": 2, "num_epochs": 1}
    topo = Topology(dp_rank=0, dp_size=1)
    full = batches(build_loader(str(dataset), topology=topo, num_workers=0, **kw))
    ld = build_loader(str(dataset), topology=topo, num_workers=2, handover_batches=4, **kw)
    it = iter(ld)
    head = [b for b in (next(it) for _ in range(6)) if b is not None]
    state = ld.state_dict()
    ld.close()
    assert state["micro_batches_in_step"] == 2
    again = build_loader(str(dataset), topology=topo, num_workers=2, handover_batches=3, **kw)
    again.load_state_dict(state)
    assert_same(head + batches(again), full)


def test_bad_handover_is_explained(dataset: Path) -> None:
    with pytest.raises(ValueError, match="handover_batches"):
        build_loader(
            str(dataset),
            topology=Topology(dp_rank=0, dp_size=1),
            micro_batch_size=2,
            global_batch_size=2,
            handover_batches=0,
        )


def test_local_shards_are_read_ahead_without_a_thread(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hinted: list[str] = []
    monkeypatch.setattr(LocalReadAhead, "_read_ahead", staticmethod(hinted.append))
    spec = dataclasses.replace(_spec(dataset), prefetch_shards=3)
    m = load_manifest(str(dataset))
    threads_before = set(threading.enumerate())
    producer = Producer(spec, 0, None)
    try:
        assert isinstance(producer.prefetcher, LocalReadAhead)
        assert set(threading.enumerate()) == threads_before  # no prefetcher thread
        order: list[int] = []  # shards in order of first need
        for k in range(60):
            for s in m.shard_of_bin(producer.bins(k)).tolist():
                if s not in order:
                    order.append(s)
        producer.produce(0)
        paths = [str(dataset / m.shards[s].path) for s in order]
        first = len(hinted)
        assert first >= 3 and hinted == paths[:first]  # the next 3 (or a little more) shards, in need order
        for k in range(1, 6):
            producer.produce(k)
        assert hinted == paths[: len(hinted)] and len(hinted) > first
    finally:
        producer.close()


@pytest.mark.parametrize("worker", [(0, 2), (1, 2)])
def test_workers_share_out_the_checks_of_the_shards_they_read_ahead(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, worker: tuple[int, int]
) -> None:
    """Worker i of n asks for exactly the coming shards s with s % n == i to be read ahead, checks and indexes
    them (the others are left to the other workers), and records both for the machine."""
    hinted: list[str] = []
    monkeypatch.setattr(LocalReadAhead, "_read_ahead", staticmethod(hinted.append))
    storage = StorageConfig(root=str(dataset), cache_dir=str(tmp_path))
    spec = dataclasses.replace(_spec(dataset), prefetch_shards=4, storage=storage)
    m = load_manifest(str(dataset))
    producer = Producer(spec, 0, None, worker=worker)
    try:
        order: list[int] = []  # shards in order of first need
        for k in range(60):
            for s in m.shard_of_bin(producer.bins(k)).tolist():
                if s not in order:
                    order.append(s)
        producer.produce(0)
        assert isinstance(producer.prefetcher, LocalReadAhead)
        coming = order[: len(producer.prefetcher._hinted)]  # the shards it looked at, mine or not
        ahead = [next(s for s, sh in enumerate(m.shards) if str(dataset / sh.path) == p) for p in hinted]
        mine = {s for s in coming if s % 2 == worker[0]}
        assert len(coming) >= 4 and mine and mine != set(coming)
        assert ahead == [s for s in coming if s % 2 == worker[0]]  # one hint per shard for the machine
        assert producer.readers.prepared == mine
        used = set(m.shard_of_bin(producer.bins(0)).tolist())  # read by micro-batch 0: checked on use
        for s, shard in enumerate(m.shards):  # recorded for the machine: what this worker checked, no more
            checked = os.path.exists(os.path.join(producer.store.meta_dir, f"{shard.sha256}.verified.json"))
            indexed = os.path.exists(producer.store.index_cache_path(shard) or "")
            assert checked == indexed == (s in mine | used), s
    finally:
        producer.close()


class _WritesPidWhenCollected:
    """Garbage in a reference cycle whose finalizer records the process that ran it."""

    def __init__(self, record: Path) -> None:
        self.record, self.me = record, self

    def __del__(self) -> None:
        with open(self.record, "a") as f:
            f.write(f"{os.getpid()}\n")


@pytest.mark.parametrize("frozen", [True, False])
def test_garbage_inherited_by_workers_is_not_collected_there(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, frozen: bool
) -> None:
    """Objects a worker inherits from the consumer (fork) are never collected in the worker, so their
    finalizers run once, in the consumer (an fsspec filesystem's finalizer in a worker waits a second for
    the consumer's event loop). Control (frozen=False: `gc.freeze` made a no-op): the worker runs it."""
    import gc

    def collect_first(self: Any, k: int, **kw: Any) -> Any:  # a collection in the worker, before its batch
        gc.collect()
        return real_produce(self, k, **kw)

    real_produce = worker_mod.Producer.produce
    monkeypatch.setattr(worker_mod.Producer, "produce", collect_first)
    if not frozen:
        monkeypatch.setattr(gc, "freeze", lambda: None)
    record = tmp_path / "collected-by.txt"
    loader = build_loader(
        str(dataset), topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=1, global_batch_size=1,
        num_workers=2, num_epochs=1, cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    gc.disable()  # the consumer keeps the garbage until after the workers are forked
    try:
        _WritesPidWhenCollected(record)
        assert sum(1 for _ in loader) == load_manifest(str(dataset)).num_bins
    finally:
        gc.enable()
    gc.collect()
    pids = record.read_text().split()
    assert str(os.getpid()) in pids
    workers = [p for p in pids if p != str(os.getpid())]
    assert (workers == []) if frozen else (len(workers) >= 1)
