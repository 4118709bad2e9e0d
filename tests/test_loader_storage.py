"""The loader reading from real servers on 127.0.0.1: moto S3 (via s3fs), plain HTTP, and a fault proxy."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import itertools
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mmpack.dataloader import ShardError, Topology, build_loader, load_manifest
from mmpack.dataloader.storage import ShardStore, StorageConfig
from mmpack.demo.synthetic import build_packed_dataset
from tests.support.loader_data import assert_same
from tests.support.storage_servers import (
    FaultPlan,
    FaultProxy,
    S3Endpoint,
    http_server,
    moto_s3,
    s3_storage_options,
)

TOPO = Topology(dp_rank=1, dp_size=2)
N_MICRO = 10


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed_dataset(tmp_path_factory.mktemp("storage"), fmt="both", max_bins_per_shard=3)


@pytest.fixture(scope="module")
def s3(dataset: Path) -> Iterator[tuple[S3Endpoint, str]]:
    with moto_s3() as endpoint:
        yield endpoint, endpoint.upload_folder(dataset, "mmpack-test", "packed")


@pytest.fixture(scope="module")
def http_url(dataset: Path) -> Iterator[str]:
    with http_server(dataset.parent) as base:
        yield f"{base}/{dataset.name}"


def stream(path: str, n: int = N_MICRO, **kw: Any) -> tuple[list[dict[str, Any]], dict[str, float]]:
    kw.setdefault("micro_batch_size", 2)
    kw.setdefault("global_batch_size", 8)
    kw.setdefault("num_workers", 2)
    kw.setdefault("seed", 5)
    ld = build_loader(path, topology=TOPO, **kw)
    batches = list(itertools.islice(iter(ld), n))
    ld.close()
    return batches, ld.metrics()


@pytest.fixture(scope="module")
def local_stream(dataset: Path) -> list[dict[str, Any]]:
    return stream(str(dataset), num_workers=0)[0]


@pytest.mark.parametrize("fmt", ["arrow", "wds"])
def test_s3_stream_equals_local_and_hits_cache_second_time(
    s3: tuple[S3Endpoint, str], local_stream: list[dict[str, Any]], tmp_path: Path, fmt: str
) -> None:
    endpoint, url = s3
    opts = endpoint.storage_options
    first, m1 = stream(url, storage_options=opts, cache_dir=str(tmp_path), shard_format=fmt)
    assert_same(first, local_stream)  # both formats hold the same bins
    assert m1["cache_misses"] > 0 and m1["bytes_read"] > 0
    second, m2 = stream(
        url, storage_options=opts, cache_dir=str(tmp_path), shard_format=fmt, prefetch_shards=0
    )
    assert_same(first, second)
    assert m2["bytes_read"] == 0 and m2["cache_hits"] > 0 and m2["cache_misses"] == 0


def test_s3_endpoint_from_environment(
    s3: tuple[S3Endpoint, str],
    local_stream: list[dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    endpoint, url = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint.endpoint_url)
    got, _ = stream(url, storage_options={"key": "testing", "secret": "testing"}, cache_dir=str(tmp_path))
    assert_same(got, local_stream)


def test_http_stream_equals_local(http_url: str, local_stream: list[dict[str, Any]], tmp_path: Path) -> None:
    got, metrics = stream(http_url, cache_dir=str(tmp_path))
    assert_same(got, local_stream)
    assert metrics["bytes_read"] > 0


ALL_FAULTS = FaultPlan(kinds=("503", "reset", "truncate", "slow", "corrupt"), max_faults_per_path=3)


def test_faults_between_loader_and_http_change_nothing(
    http_url: str, local_stream: list[dict[str, Any]], tmp_path: Path
) -> None:
    base, _, rest = http_url.removeprefix("http://").partition("/")
    # Every GET may fail here, the manifest's included.
    plan = FaultPlan(
        kinds=ALL_FAULTS.kinds, max_faults_per_path=ALL_FAULTS.max_faults_per_path, fault_path_part="/"
    )
    with FaultProxy(f"http://{base}", plan) as proxy:
        got, metrics = stream(f"{proxy.url}/{rest}", cache_dir=str(tmp_path))
        faults = proxy.faults_injected
    assert_same(got, local_stream)
    assert faults > 0 and metrics["retries"] > 0 and metrics["redownloads"] > 0
    assert plan.injected.get(f"/{rest}/manifest.json", 0) > 0


def test_faults_between_loader_and_s3_change_nothing(
    s3: tuple[S3Endpoint, str], local_stream: list[dict[str, Any]], tmp_path: Path
) -> None:
    endpoint, url = s3
    plan = FaultPlan(kinds=ALL_FAULTS.kinds, max_faults_per_path=ALL_FAULTS.max_faults_per_path)
    with FaultProxy(endpoint.endpoint_url, plan) as proxy:
        got, metrics = stream(url, storage_options=s3_storage_options(proxy.url), cache_dir=str(tmp_path))
        faults = proxy.faults_injected
    assert_same(got, local_stream)
    assert faults > 0 and metrics["retries"] > 0


def test_persistently_corrupt_shard_fails_naming_it(dataset: Path, tmp_path: Path) -> None:
    copy = tmp_path / "served" / "packed"
    shutil.copytree(dataset, copy)
    m = load_manifest(str(copy))
    bad = m.shards[0]
    data = bytearray((copy / bad.path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / bad.path).write_bytes(bytes(data))
    with http_server(copy.parent) as base:
        store = ShardStore(
            StorageConfig(
                root=f"{base}/packed", cache_dir=str(tmp_path / "c"), max_attempts=3, backoff_s=0.01
            )
        )
        with pytest.raises(ShardError, match=bad.path) as err:
            store.local_path(bad)
        assert "after 3 attempts" in str(err.value) and "sha256" in str(err.value)
        assert store.metrics.redownloads == 3
        left = [f for f in (tmp_path / "c").rglob("*") if f.is_file() and not f.name.endswith(".lock")]
        assert not left  # nothing bad (and no reservation) left in the cache
        # The same through the loader and its worker processes: a clear error, not a hang.
        with pytest.raises(ShardError, match=r"shards/.*could not be read correctly"):
            stream(f"{base}/packed", n=10**6, cache_dir=str(tmp_path / "d"), max_attempts=2, num_epochs=1)
    with pytest.raises(ShardError, match="is corrupted"):
        stream(str(copy), n=10**6, num_workers=0, num_epochs=1)


def test_missing_shard_fails_naming_it(dataset: Path, tmp_path: Path) -> None:
    copy = tmp_path / "served" / "packed"
    shutil.copytree(dataset, copy)
    gone = load_manifest(str(copy)).shards[-1]
    os.unlink(copy / gone.path)
    with http_server(copy.parent) as base:
        store = ShardStore(StorageConfig(root=f"{base}/packed", cache_dir=str(tmp_path / "c")))
        with pytest.raises(ShardError, match=f"{gone.path} not found"):
            store.local_path(gone)


def test_cache_never_exceeds_its_bound(
    s3: tuple[S3Endpoint, str], dataset: Path, local_stream: list[dict[str, Any]], tmp_path: Path
) -> None:
    endpoint, url = s3
    m = load_manifest(str(dataset))
    limit = int(2.5 * max(s.bytes for s in m.shards))
    cache = tmp_path / "cache"
    sizes: list[int] = []
    done = threading.Event()

    def cache_bytes() -> int:
        """Shards and reservations; `.meta/` (small per-shard facts) is documented as not counted."""
        sizes: dict[int, int] = {}  # by inode: a `.part` renamed into place while we list may show twice
        for folder, dirs, files in os.walk(cache):
            dirs[:] = [d for d in dirs if d != ".meta"]
            for name in files:
                with contextlib.suppress(FileNotFoundError):  # evicted while we look
                    st = os.stat(os.path.join(folder, name))
                    sizes[st.st_ino] = st.st_size
        return sum(sizes.values())

    def watch() -> None:
        while not done.is_set():
            locks = list(cache.glob("*/.locks/.cache.lock"))  # <cache_dir>/<dataset tag>/.locks/
            if not locks:  # nothing reserved yet
                sizes.append(cache_bytes())
                continue
            (lock,) = locks
            # Space only grows under the cache-wide lock: holding it gives a consistent snapshot (a walk
            # racing an eviction and a new reservation could count both).
            with open(lock, "rb") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                try:
                    sizes.append(cache_bytes())
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        steps = 2 * m.num_bins // 8  # two epochs
        got, metrics = stream(
            url,
            n=steps * 2,
            storage_options=endpoint.storage_options,
            cache_dir=str(cache),
            cache_limit_bytes=limit,
        )
    finally:
        done.set()
        watcher.join()
    assert_same(got[:N_MICRO], local_stream)
    assert max(sizes) <= limit and len(sizes) > 10
    assert metrics["evictions"] > 0
    with pytest.raises(ShardError, match="larger than cache_limit_bytes"):
        stream(
            url,
            n=1,
            storage_options=endpoint.storage_options,
            cache_dir=str(tmp_path / "tiny"),
            cache_limit_bytes=16,
            num_workers=0,
        )


def test_cache_is_keyed_by_digest(dataset: Path, tmp_path: Path) -> None:
    """A dataset rewritten at the same URL never serves stale cached bytes."""
    served = tmp_path / "served" / "packed"
    shutil.copytree(dataset, served)
    shard = load_manifest(str(served)).shards[0]
    with http_server(served.parent) as base:
        store = ShardStore(StorageConfig(root=f"{base}/packed", cache_dir=str(tmp_path / "c")))
        old_path = store.local_path(shard)
        new_bytes = (served / load_manifest(str(served)).shards[1].path).read_bytes()
        (served / shard.path).write_bytes(new_bytes)
        rewritten = dataclasses.replace(
            shard, bytes=len(new_bytes), sha256=hashlib.sha256(new_bytes).hexdigest()
        )
        new_path = store.local_path(rewritten)
        assert new_path != old_path and Path(new_path).read_bytes() == new_bytes
        assert store.metrics.cache_misses == 2 and store.local_path(rewritten) == new_path
        assert store.metrics.cache_hits == 1


def test_ranks_sharing_one_cache_folder(s3: tuple[S3Endpoint, str], dataset: Path, tmp_path: Path) -> None:
    """Two DP ranks (each with worker processes) on one node share a small cache; streams stay exact."""
    endpoint, url = s3
    m = load_manifest(str(dataset))
    limit = 3 * max(s.bytes for s in m.shards)
    kw: dict[str, Any] = {"micro_batch_size": 2, "global_batch_size": 8, "seed": 2, "num_epochs": 1}
    expected = [
        list(build_loader(str(dataset), topology=Topology(dp_rank=r, dp_size=2), num_workers=0, **kw))
        for r in range(2)
    ]
    shared = [
        build_loader(
            url,
            topology=Topology(dp_rank=r, dp_size=2),
            num_workers=2,
            storage_options=endpoint.storage_options,
            cache_dir=str(tmp_path),
            cache_limit_bytes=limit,
            **kw,
        )
        for r in range(2)
    ]
    its = [iter(ld) for ld in shared]
    got: list[list[dict[str, Any]]] = [[], []]
    for _ in range(len(expected[0])):  # lockstep, as in training
        for r in range(2):
            got[r].append(next(its[r]))
    for r in range(2):
        assert_same(got[r], expected[r])
        shared[r].close()
    assert sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) <= limit


@pytest.mark.parametrize("server", ["http", "s3"])
@pytest.mark.parametrize("whole_read_max_bytes", [0, 64 << 20])  # streamed reads, one-GET reads
def test_shard_reads_through_faults_give_exact_bytes(
    s3: tuple[S3Endpoint, str],
    http_url: str,
    dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    server: str,
    whole_read_max_bytes: int,
) -> None:
    import mmpack.dataloader.storage.store as store

    monkeypatch.setattr(store, "WHOLE_READ_MAX_BYTES", whole_read_max_bytes)
    monkeypatch.setattr(store, "CHUNK_BYTES", 4096)  # several chunks per shard when streamed
    endpoint, s3_url = s3
    m = load_manifest(str(dataset))
    if server == "http":
        base, _, rest = http_url.removeprefix("http://").partition("/")
        upstream, opts = f"http://{base}", None
    else:
        upstream, rest = endpoint.endpoint_url, s3_url.removeprefix("s3://")
    plan = FaultPlan(kinds=ALL_FAULTS.kinds, max_faults_per_path=ALL_FAULTS.max_faults_per_path)
    with FaultProxy(upstream, plan) as proxy:
        if server == "http":
            root = f"{proxy.url}/{rest}"
        else:
            root, opts = s3_url, s3_storage_options(proxy.url)
        store = ShardStore(
            StorageConfig(root=root, storage_options=opts, cache_dir=str(tmp_path), backoff_s=0.01)
        )
        for shard in m.shards:
            assert Path(store.local_path(shard)).read_bytes() == (dataset / shard.path).read_bytes()
        faults = proxy.faults_injected
    # Which faults surface as our retries or redownloads depends on the client (botocore checks checksums).
    assert faults > 0 and store.metrics.retries > 0


def test_local_shards_are_hashed_once_per_machine(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process (a new ShardStore) trusts the recorded check; a rewritten shard is checked again."""
    import mmpack.dataloader.storage.store as storage

    copy = tmp_path / "packed"
    shutil.copytree(dataset, copy)
    shard = load_manifest(str(copy), shard_format="wds").shards[0]
    config = StorageConfig(root=str(copy), cache_dir=str(tmp_path / "cache"))
    hashed: list[str] = []
    real = storage.sha256_file

    def counting_sha256(p: str) -> str:
        hashed.append(p)
        return real(p)

    monkeypatch.setattr(storage, "sha256_file", counting_sha256)
    ShardStore(config).local_path(shard)
    ShardStore(config).local_path(shard)
    assert len(hashed) == 1
    path = copy / shard.path
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # same size, other content
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    with pytest.raises(ShardError, match=rf"shard {shard.path} .* is corrupted"):
        ShardStore(config).local_path(shard)
    assert len(hashed) == 2


def test_local_check_record_follows_the_folder_a_link_points_to(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record names the shard under the dataset folder's resolved path (worked out once per store): a
    link moved to an identical copy (same size and mtime, another file) gets the copy checked again."""
    import mmpack.dataloader.storage.store as storage

    for name in ("a", "b"):
        shutil.copytree(dataset, tmp_path / name, copy_function=shutil.copy2)  # copy2 keeps mtimes
    link = tmp_path / "current"
    link.symlink_to(tmp_path / "a")
    shard = load_manifest(str(link), shard_format="wds").shards[0]
    config = StorageConfig(root=str(link), cache_dir=str(tmp_path / "cache"))
    hashed: list[str] = []
    real = storage.sha256_file
    monkeypatch.setattr(storage, "sha256_file", lambda p: hashed.append(p) or real(p))
    store = ShardStore(config)
    store.local_path(shard)
    record = storage.read_json(os.path.join(store.meta_dir, f"{shard.sha256}.verified.json"))
    assert record["path"] == str((tmp_path / "a").resolve() / shard.path)
    ShardStore(config).local_path(shard)
    assert len(hashed) == 1  # trusted while the link points to the same folder
    link.unlink()
    link.symlink_to(tmp_path / "b")
    ShardStore(config).local_path(shard)
    assert len(hashed) == 2  # control: the same bytes in another file are checked again


@contextlib.contextmanager
def _unwritable(folder: Path) -> Iterator[None]:
    """`folder` made unwritable for this process: chmod, or (as root, whom modes do not stop) the immutable flag."""
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip(
            "running as root on a file system without the immutable flag: cannot make a folder read-only"
        )
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_read_only_cache_folder_is_one_clear_error(s3: tuple[S3Endpoint, str], tmp_path: Path) -> None:
    endpoint, url = s3
    cache = tmp_path / "ro-cache"
    with _unwritable(cache), pytest.raises(ShardError) as info:
        stream(url, storage_options=endpoint.storage_options, cache_dir=str(cache))
    message = str(info.value)
    assert (
        "\n" not in message
        and str(cache) in message
        and "cannot be written" in message
        and "--data-cache-dir" in message
    )


def test_damaged_cached_copy_is_checked_again_and_fetched_again(
    s3: tuple[S3Endpoint, str], local_stream: list[dict[str, Any]], tmp_path: Path
) -> None:
    """A cached copy changed after it was verified is not used by the next process: checked, removed, fetched."""
    endpoint, url = s3
    opts = endpoint.storage_options
    stream(url, storage_options=opts, cache_dir=str(tmp_path), num_workers=1)  # fills the cache
    cached = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".arrow", ".tar"))
    assert cached
    victim = cached[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size: a damaged disk or a stray write
    victim.write_bytes(bytes(data))
    shard = next(
        s
        for s in load_manifest(url, storage_options=opts).shards
        if victim.name.endswith(s.path.replace("/", "__"))
    )
    assert hashlib.sha256(victim.read_bytes()).hexdigest() != shard.sha256  # control: the copy is damaged
    store = ShardStore(
        StorageConfig(root=url, cache_dir=str(tmp_path), storage_options=opts)
    )  # another process
    path = store.local_path(shard)
    assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == shard.sha256
    assert store.metrics.redownloads == 1 and store.metrics.cache_misses == 1
    again, metrics = stream(
        url, storage_options=opts, cache_dir=str(tmp_path), num_workers=2, prefetch_shards=0
    )
    assert_same(again, local_stream)
    assert metrics["cache_hits"] > 0 and metrics["bytes_read"] == 0  # the good copies are used as they are
