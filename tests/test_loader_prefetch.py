"""Concurrent shard downloads: the prefetcher's download threads, a ShardStore shared by threads and processes."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import itertools
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmpack.dataloader import Topology, build_loader, load_manifest
from mmpack.dataloader.manifest import Manifest
from mmpack.dataloader.storage import ShardStore, StorageConfig, flock
from mmpack.dataloader.storage import store as storage_mod
from mmpack.dataloader.worker import Producer, ProducerSpec
from mmpack.demo.synthetic import build_packed_dataset
from tests.support.loader_data import assert_same


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed_dataset(tmp_path_factory.mktemp("prefetch"), fmt="wds", max_bins_per_shard=3)


class CountingServer:
    """Serves a folder over HTTP on 127.0.0.1, counting GETs per path; `drip_s` > 0 sends bodies 1 KiB
    at a time with that pause (a slow store, so downloads stay in flight)."""

    def __init__(self, directory: Path, drip_s: float = 0.0) -> None:
        self.gets: Counter[str] = Counter()
        self.started = threading.Event()  # set by the first GET of a shard
        lock = threading.Lock()
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, directory=str(directory), **kw)

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                with lock:
                    server.gets[self.path] += 1
                if "/shards/" not in self.path:
                    return super().do_GET()
                server.started.set()
                data = Path(self.translate_path(self.path)).read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                step = 1024 if drip_s else len(data)
                with contextlib.suppress(OSError):  # the client may give up mid-body
                    for i in range(0, len(data), step):
                        self.wfile.write(data[i : i + step])
                        self.wfile.flush()
                        time.sleep(drip_s)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> CountingServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def shard_gets(self) -> dict[str, int]:
        return {p: n for p, n in self.gets.items() if "/shards/" in p}


def shard_urls(m: Manifest, prefix: str) -> set[str]:
    return {f"{prefix}/{s.path}" for s in m.shards}


def producer_spec(url: str, cache: Path, *, threads: int, ahead: int) -> ProducerSpec:
    ld = build_loader(
        url, topology=Topology(dp_rank=0, dp_size=1), micro_batch_size=2, global_batch_size=2, num_workers=0
    )
    spec = ld.spec
    ld.close()
    storage = dataclasses.replace(spec.storage, cache_dir=str(cache), download_concurrency=threads)
    return dataclasses.replace(spec, storage=storage, prefetch_shards=ahead)


def download_threads(producer: Producer) -> list[threading.Thread]:
    """The download threads of this producer's prefetcher (other tests' loaders may still have theirs)."""
    prefix = producer.prefetcher.thread_prefix + "_"
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def wait_until(cond: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_flock_excludes_threads_of_one_process(tmp_path: Path) -> None:
    """flock belongs to the open file description: two opens of one path in one process exclude each other."""
    path = str(tmp_path / "x.lock")
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with flock(path) as got:
            assert got
            held.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(30)
        with flock(path, blocking=False) as got:
            assert not got
    finally:
        release.set()
        t.join(30)
    with flock(path, blocking=False) as got:
        assert got


def test_store_shared_by_threads_downloads_each_shard_once(dataset: Path, tmp_path: Path) -> None:
    m = load_manifest(str(dataset))
    with CountingServer(dataset.parent) as server:
        store = ShardStore(StorageConfig(root=f"{server.url}/{dataset.name}", cache_dir=str(tmp_path)))
        calls = [s for s in m.shards for _ in range(6)]
        paths: dict[str, set[str]] = {}
        lock = threading.Lock()

        def take(i: int) -> None:
            for s in calls[i::8]:
                p = store.local_path(s)
                with lock:
                    paths.setdefault(s.path, set()).add(p)

        threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        gets = server.shard_gets()
    assert gets == {u: 1 for u in shard_urls(m, f"/{dataset.name}")}
    for s in m.shards:
        (p,) = paths[s.path]
        assert Path(p).read_bytes() == (dataset / s.path).read_bytes()
    mt = store.metrics
    assert mt.cache_hits + mt.cache_misses == len(calls) and mt.cache_misses >= len(m.shards)
    assert mt.bytes_read == sum(s.bytes for s in m.shards)
    # Only shards at the top of the cache folder; one lock file per shard (plus the cache-wide one) in .locks/
    top = sorted(os.listdir(store.cache_dir))
    assert top == sorted([".locks", ".meta"] + [os.path.basename(store._cache_path(s)) for s in m.shards])
    locks = os.listdir(os.path.join(store.cache_dir, ".locks"))
    assert len(locks) == len(m.shards) + 1 and all(n.endswith(".lock") for n in locks)


def test_prefetcher_runs_downloads_concurrently_once_each(dataset: Path, tmp_path: Path) -> None:
    m = load_manifest(str(dataset))
    with CountingServer(dataset.parent, drip_s=0.002) as server:
        spec = producer_spec(f"{server.url}/{dataset.name}", tmp_path, threads=3, ahead=len(m.shards))
        n = m.num_bins // 2
        producer = Producer(spec, 0, n)
        try:
            in_flight = 0

            def count_in_flight() -> bool:
                nonlocal in_flight
                in_flight = max(in_flight, len(download_threads(producer)))
                return not producer.prefetcher.is_alive()

            assert wait_until(count_in_flight)
            assert wait_until(lambda: not download_threads(producer))
            for k in range(n):  # everything is cached now: the consumer only hits
                producer.prefetcher.advance(k)
                producer.produce(k)
        finally:
            producer.close()
        gets = server.shard_gets()
    assert in_flight > 1  # more than one download thread was busy
    assert gets == {u: 1 for u in shard_urls(m, f"/{dataset.name}")}
    assert producer.store.metrics.cache_misses == 0 and producer.store.metrics.cache_hits > 0


def test_ranks_sharing_a_cache_download_each_shard_once(dataset: Path, tmp_path: Path) -> None:
    """Two ranks, each with two worker processes and four download threads per worker, one cache folder."""
    m = load_manifest(str(dataset))
    kw: dict[str, Any] = {"micro_batch_size": 2, "global_batch_size": 4, "seed": 3, "num_epochs": 1}
    expected: list[list[Any]] = [
        list(build_loader(str(dataset), topology=Topology(dp_rank=r, dp_size=2), num_workers=0, **kw))
        for r in range(2)
    ]
    with CountingServer(dataset.parent) as server:
        loaders = [
            build_loader(
                f"{server.url}/{dataset.name}",
                topology=Topology(dp_rank=r, dp_size=2),
                num_workers=2,
                cache_dir=str(tmp_path),
                prefetch_shards=8,
                **kw,
            )
            for r in range(2)
        ]
        its = [iter(ld) for ld in loaders]
        got: list[list[dict[str, Any]]] = [[], []]
        for _ in range(len(expected[0])):
            for r in range(2):
                batch = next(its[r])
                assert batch is not None
                got[r].append(batch)
        for ld in loaders:
            ld.close()
        gets = server.shard_gets()
    for r in range(2):
        assert_same(got[r], expected[r])
    bins = np.concatenate([np.asarray(b.bin_ids) for batches in got for b in batches])
    needed = {f"/{dataset.name}/{m.shards[s].path}" for s in m.shard_of_bin(bins).tolist()}
    assert set(gets) >= needed and set(gets.values()) == {1}


@pytest.mark.parametrize("streaming", [False, True])
def test_stop_while_downloads_are_in_flight(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, streaming: bool
) -> None:
    """Closing the producer ends the prefetcher and its downloads without waiting for the slow store;
    a streaming download gives up at its next chunk and leaves no partial file."""
    if streaming:
        monkeypatch.setattr(storage_mod, "WHOLE_READ_MAX_BYTES", 0)
        monkeypatch.setattr(storage_mod, "CHUNK_BYTES", 1024)
    m = load_manifest(str(dataset))
    with CountingServer(dataset.parent, drip_s=0.05) as server:  # >= 2 s per shard
        spec = producer_spec(f"{server.url}/{dataset.name}", tmp_path, threads=2, ahead=len(m.shards))
        producer = Producer(spec, 0, None)
        assert server.started.wait(30)
        producer.close()
        producer.prefetcher.join(30)
        assert not producer.prefetcher.is_alive()
        assert wait_until(lambda: not download_threads(producer))
        gets = server.shard_gets()
    assert 1 <= sum(gets.values()) <= 2  # no download started after the stop
    left = list(itertools.chain.from_iterable(files for _, _, files in os.walk(producer.store.cache_dir)))
    assert not [f for f in left if f.endswith(".part")]
    if streaming:
        assert not [f for f in left if not f.endswith(".lock")]  # given up, nothing cached


def test_prefetcher_leaves_cached_shards_to_the_reader(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards already in the cache start no download thread (the reader finds them when it opens them); with
    an empty cache (the control) every coming shard gets one."""
    started: list[str] = []
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        started.append(self.name)
        real_start(self)

    m = load_manifest(str(dataset))
    with CountingServer(dataset.parent) as server:
        url = f"{server.url}/{dataset.name}"
        n = m.num_bins // 2
        for round_ in ("empty cache", "cached"):
            spec = producer_spec(url, tmp_path, threads=2, ahead=len(m.shards))
            monkeypatch.setattr(threading.Thread, "start", start)
            started.clear()
            producer = Producer(spec, 0, n)
            try:
                assert wait_until(lambda p=producer: not p.prefetcher.is_alive())
                assert wait_until(lambda p=producer: not download_threads(p))
                for k in range(n):
                    producer.prefetcher.advance(k)
                    producer.produce(k)
            finally:
                producer.close()
                monkeypatch.undo()
            downloads = [t for t in started if t.startswith(producer.prefetcher.thread_prefix + "_")]
            if round_ == "empty cache":
                assert len(downloads) == len(m.shards)
            else:
                assert downloads == [] and producer.store.metrics.cache_hits > 0
        assert server.shard_gets() == {u: 1 for u in shard_urls(m, f"/{dataset.name}")}
