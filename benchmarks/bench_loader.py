"""Loader throughput, side by side on the same packed WebDataset shards, from local disk and from moto S3.

Contenders (same decoding and batching: npy/json members, Pillow decode + patchify, mmpack.packing.layout collation):
  raw        sequential read of every shard's bytes (the storage's read bandwidth; no decoding)
  webdataset plain `webdataset` pipeline + WebLoader (shards in order, split by worker)
  energon    Megatron-Energon (`get_train_dataset` + `get_loader` over the dataset's `.nv-meta`, from local disk
             and, through Multi-Storage Client (msc://), from S3; its own tar reading and array decoding, the
             same image decoding and collation)
  mmpack     `mmpack.dataloader.build_loader` (global shuffled order, sha256 checks, cache, read-ahead), first use on
             the machine: every shard checked against its sha256 and its tar index worked out
  mmpack, checked before  the same with the per-machine facts of the first run in place (a restarted job)
  mmpack storage  the loader's storage path alone: `ShardStore` fetching (local: checking) every shard into an
             empty cache with the prefetcher's number of threads, nothing decoded
  decode     the CPU ceiling: `--workers` processes decode and collate every bin (micro-batches dealt out in
             turn) from shards already in memory (no storage, order, checks, or hand-over to a consumer): what
             the same decoding on as many processes costs on this machine

Storages: local disk; moto S3 (`python -m moto.server` in its own process, on the same cores); "s3-link", the
same server behind a proxy process that paces all response bodies to `--link-mb-s` together, a link slower than
decoding, so that the storage and not the CPU is the bottleneck.

Local files are evicted from the page cache (posix_fadvise DONTNEED) before each contender, so "local" means
the disk, not memory; the warm (page cache) raw read is reported beside it. Reported per contender and
storage: bins/s and MB/s of shard bytes end to end and in steady state (after the first batch), time to first
batch, the data-wait fraction when a consumer takes a fixed time per micro-batch, and the peak memory of the
loader (PSS summed over the consumer's process and the loader's worker processes, sampled from
/proc/<pid>/smaps_rollup every 50 ms during a full pass of its own, so that sampling does not slow the timed
pass; also its anonymous + shared-memory part alone, which other processes mapping the same libraries do not
move). Usage:

    python benchmarks/bench_loader.py [--samples 2000] [--workers 2] [--step-ms 400] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.pss import PeakPss  # noqa: E402
from mmpack.dataloader import Topology, build_loader, load_manifest  # noqa: E402
from mmpack.dataloader.collate import CollateConfig, collate_bins  # noqa: E402
from mmpack.dataloader.readers import WdsShardReader, decode_wds_bin  # noqa: E402
from mmpack.dataloader.storage import ShardStore, StorageConfig  # noqa: E402
from mmpack.demo.synthetic import build_packed_dataset  # noqa: E402
from mmpack.packing.batch import MicroBatch  # noqa: E402
from tests.support.storage_servers import link_proxy_process, moto_s3, s3_storage_options  # noqa: E402


# -- plain webdataset -----------------------------------------------------------------------------------------
def wds_sample_to_record(sample: dict[str, Any]) -> dict[str, Any]:
    """A webdataset sample (member suffix -> bytes) to the record the collation takes."""
    return decode_wds_bin(sample["__key__"], sample, sample.__getitem__, label=sample.get("__url__", "wds"))


def fsspec_opener(
    storage_options: dict[str, Any],
) -> Callable[[Iterable[dict[str, Any]]], Iterator[dict[str, Any]]]:
    def open_urls(src: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        from fsspec.core import url_to_fs

        for sample in src:
            fs, path = url_to_fs(sample["url"], **storage_options)
            with fs.open(path, "rb", block_size=8 << 20) as stream:
                yield {**sample, "stream": stream}

    return open_urls


def _collate_dict(records: list[dict[str, Any]], cfg: CollateConfig) -> dict[str, Any]:
    """`collate_bins` as a plain dict of its fields: what a contender's own loader moves between processes."""
    return dict(collate_bins(records, cfg).items())


def _rows(batch: Any) -> int:
    """Bins of a micro-batch: a `MicroBatch` (mmpack's loader) or its fields as a dict (the contenders')."""
    return int(batch.shape[0]) if isinstance(batch, MicroBatch) else int(batch["tokens"].shape[0])


def webdataset_loader(
    urls: list[str], cfg: CollateConfig, micro: int, workers: int, storage_options: dict[str, Any] | None
) -> Iterable[Any]:
    import webdataset as wds
    from webdataset.tariterators import group_by_keys, tar_file_expander, url_opener

    opener = url_opener if storage_options is None else fsspec_opener(storage_options)
    pipe = wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.split_by_worker,
        opener,
        wds.pipelinefilter(tar_file_expander)(),
        wds.pipelinefilter(group_by_keys)(),
        wds.map(wds_sample_to_record),
        wds.batched(micro, collation_fn=partial(_collate_dict, cfg=cfg), partial=False),
    )
    return wds.WebLoader(pipe, batch_size=None, num_workers=workers, persistent_workers=False)


# -- Megatron-Energon ----------------------------------------------------------------------------------------
def energon_loader(root: str, cfg: CollateConfig, micro: int, workers: int) -> Iterable[Any]:
    """Energon's loader over the dataset's `.nv-meta` (PackedBinSample), batching with `collate_bins`.

    Its decoder reads the json member and the arrays (with mmpack's `.npy` decoding, as the other contenders)
    and leaves images as bytes, which the collation decodes, as for the other contenders.
    """
    from megatron.energon import DefaultTaskEncoder, WorkerConfig, get_loader, get_train_dataset

    from mmpack.dataloader.readers.npy import decode_npy
    from mmpack.dataloader.readers.record import no_videos
    from mmpack.packing.format import ARRAY_FIELDS

    class JsonOnlyDecoder:
        def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
            return {
                k: json.loads(v) if k == "json" else decode_npy(v) if k.endswith(".npy") else v
                for k, v in sample.items()
            }

        def config(self) -> dict[str, Any]:
            return {"decoder": "json only"}

    class CollateEncoder(DefaultTaskEncoder):  # type: ignore[misc]
        decoder = JsonOnlyDecoder()

        def encode_sample(self, sample: Any) -> dict[str, Any]:
            rec: dict[str, Any] = {"key": sample.__key__, "sample_ids": list(sample.sample_ids)}
            for name, dtype in ARRAY_FIELDS.items():
                rec[name] = np.asarray(getattr(sample, name), dtype=dtype)
            rec["image_grid_thw"] = rec["image_grid_thw"].reshape(-1, 3)
            rec["images"] = [bytes(b) for b in sample.images]
            rec["image_formats"] = list(sample.image_formats)
            return rec | no_videos()

        def batch(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
            return _collate_dict(samples, cfg)

        def encode_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
            return batch

    ds = get_train_dataset(
        root,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers),
        batch_size=micro,
        batch_drop_last=True,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
        task_encoder=CollateEncoder(),
    )
    return get_loader(ds)  # type: ignore[no-any-return]


def energon_msc_url(endpoint_url: str, url: str, tmp: Path) -> str:
    """The Multi-Storage Client URL under which Energon reads the S3 copy `url` (s3://bucket/prefix) from the
    server at `endpoint_url`: a profile in an MSC config file written to `tmp`, named by $MSC_CONFIG (read by
    Energon's processes, forked from this one). No MSC cache is configured: Energon reads every shard from S3."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    config = tmp / "msc_config.yaml"
    config.write_text(
        "profiles:\n  bench:\n    storage_provider:\n      type: s3\n      options:\n"
        f"        base_path: {bucket}\n        endpoint_url: {endpoint_url}\n        region_name: us-east-1\n"
        "    credentials_provider:\n      type: S3Credentials\n      options:\n"
        "        access_key: testing\n        secret_key: testing\n"
    )
    os.environ["MSC_CONFIG"] = str(config)
    return f"msc://bench/{prefix}"


def has_energon(root: str) -> bool:
    """Whether Megatron-Energon is installed and the dataset has its `.nv-meta` folder."""
    return importlib.util.find_spec("megatron.energon") is not None and os.path.isdir(
        os.path.join(root, ".nv-meta")
    )


def add_energon_metadata(dataset: Path) -> None:
    """Writes `.nv-meta` for the dataset's WebDataset shards, as `mmpack pack --energon` does."""
    from mmpack.offline_packing.outputs.energon_meta import write_energon_metadata

    manifest = json.loads((dataset / "manifest.json").read_text())
    write_energon_metadata(dataset, [e for e in manifest["shards"] if e["format"] == "wds"])


# -- measurement ---------------------------------------------------------------------------------------------
def peak_memory(make: Callable[[], Iterable[Any]], total_bytes: int) -> dict:
    """Another full pass over `make()`, for the peak PSS of this process and the ones the loader starts.

    Its own pass: reading /proc/<pid>/smaps_rollup of every process 20 times a second costs CPU (and, from a
    thread of the consumer's process, its GIL), which would slow the pass being timed."""
    with PeakPss() as pss:
        measure(make, total_bytes, 0.0, None)
    return {"peak_pss_MB": pss.peak_kb / 1024, "peak_pss_anon_shmem_MB": pss.peak_anon_shmem_kb / 1024}


def measure(
    make: Callable[[], Iterable[Any]], total_bytes: int, step_s: float, max_batches: int | None
) -> dict:
    """One pass over `make()`: time to first batch, bins/s, MB/s; with step_s > 0, the data-wait fraction."""
    t0 = time.perf_counter()
    it = iter(make())
    first = None
    t_first = t0
    bins = batches = first_bins = 0
    wait = 0.0
    while max_batches is None or batches < max_batches:
        t_req = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        now = time.perf_counter()
        if first is None:
            first, t_first = now - t0, now
        else:
            wait += now - t_req  # data wait after the first batch (that one is time to first batch)
        bins += _rows(batch)
        if batches == 0:
            first_bins = bins
        batches += 1
        del batch  # the consumer drops its batch within its step (freeing shared memory takes a few ms)
        if step_s:
            time.sleep(step_s)
    elapsed = time.perf_counter() - t0
    close = getattr(it, "close", None)
    if close is not None:
        close()
    del it
    gc.collect()  # the loader's workers end here, not during the next contender
    out = {"batches": batches, "bins": bins, "seconds": elapsed, "time_to_first_batch_s": first}
    if step_s:
        out["data_wait_fraction"] = wait / max(time.perf_counter() - t_first, 1e-9) if batches > 1 else 0.0
    else:
        out["bins_per_s"] = bins / elapsed
        out["MB_per_s"] = total_bytes / elapsed / 1e6
        # Steady state: everything after the first batch (its bins' share of the shard bytes).
        after = elapsed - (first or 0.0)
        rest = bins - first_bins
        out["steady_bins_per_s"] = rest / after if rest > 0 and after > 0 else None
        out["steady_MB_per_s"] = total_bytes * rest / bins / after / 1e6 if rest > 0 and after > 0 else None
    return out


def evict_from_page_cache(paths: list[str]) -> None:
    """Drops the clean cached pages of local files, so the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _decode_share(
    shards: list[tuple[str, int]],
    cfg: CollateConfig,
    micro: int,
    share: tuple[int, int],
    start: Any,
    out: Any,
) -> None:
    """Decodes and collates micro-batches share[0], share[0] + share[1], ... of all bins in file order."""
    for path, _ in shards:  # warm: the ceiling reads from memory
        with open(path, "rb") as f:
            while f.read(8 << 20):
                pass
    bins = [(path, row) for path, count in shards for row in range(count)]
    start.wait()
    t0 = time.perf_counter()
    readers: dict[str, WdsShardReader] = {}
    done = 0
    for b0 in range(share[0] * micro, len(bins), share[1] * micro):
        records = []
        for path, row in bins[b0 : b0 + micro]:
            if path not in readers:
                readers[path] = WdsShardReader(path, label=path)
            records.append(readers[path].read(row))
        done += collate_bins(records, cfg).shape[0]
    for reader in readers.values():
        reader.close()
    out[share[0]] = (done, time.perf_counter() - t0)


def decode_ceiling(
    shards: list[tuple[str, int]], cfg: CollateConfig, micro: int, workers: int, total_bytes: int
) -> dict:
    """`workers` processes decode and collate their share of the shards from memory, started together."""
    ctx = mp.get_context("fork")
    start = ctx.Barrier(workers + 1)
    out = ctx.Manager().dict()
    procs = [
        ctx.Process(target=_decode_share, args=(shards, cfg, micro, (w, workers), start, out))
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    start.wait()
    t0 = time.perf_counter()
    for p in procs:
        p.join()
    elapsed = time.perf_counter() - t0
    if any(p.exitcode != 0 for p in procs) or len(out) != workers:
        raise RuntimeError("a decode-ceiling process failed")
    bins = sum(b for b, _ in out.values())
    return {
        "bins": bins,
        "seconds": elapsed,
        "bins_per_s": bins / elapsed,
        "MB_per_s": total_bytes / elapsed / 1e6,
    }


def storage_path(root: str, storage_options: dict[str, Any] | None, cache_dir: str) -> dict:
    """mmpack's storage path alone: every shard fetched (or, local, checked) by `ShardStore` with as many
    threads as the loader's prefetcher uses, into an empty cache; no decoding."""
    from concurrent.futures import ThreadPoolExecutor

    m = load_manifest(root, storage_options=storage_options, shard_format="wds")
    store = ShardStore(StorageConfig(root=root, cache_dir=cache_dir, storage_options=storage_options))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(store.config.download_concurrency) as pool:
        if not all(pool.map(store.fetch, m.shards)):
            raise RuntimeError("a shard was not fetched")
    elapsed = time.perf_counter() - t0
    size = sum(s.bytes for s in m.shards)
    return {
        "seconds": elapsed,
        "MB_per_s": size / elapsed / 1e6,
        "time_to_first_batch_s": None,
        "bytes": size,
    }


def raw_read(urls: list[str], storage_options: dict[str, Any] | None) -> dict:
    """Every shard read whole, one after the other, the fastest plain way: local files with read(), objects with
    one GET each (s3fs `cat_file` without its size lookup)."""
    from fsspec.core import url_to_fs

    t0 = time.perf_counter()
    first = None
    size = 0
    for url in urls:
        if storage_options is None:
            with open(url, "rb") as f:
                while chunk := f.read(8 << 20):
                    size += len(chunk)
        else:
            fs, path = url_to_fs(url, **storage_options)
            extra = {"max_concurrency": 1} if url.startswith("s3://") else {}
            size += len(fs.cat_file(path, **extra))
        first = first if first is not None else time.perf_counter() - t0
    elapsed = time.perf_counter() - t0
    return {
        "seconds": elapsed,
        "MB_per_s": size / elapsed / 1e6,
        "time_to_first_batch_s": first,
        "bytes": size,
    }


def median_pass(runs: list[dict]) -> dict:
    """The pass of median steady throughput among repeated full passes, with every pass's figures kept."""
    ranked = sorted(runs, key=lambda r: r.get("steady_MB_per_s") or r.get("MB_per_s") or 0.0)
    keep = ("steady_MB_per_s", "MB_per_s", "bins_per_s")
    return ranked[(len(ranked) - 1) // 2] | {
        "runs": [{k: r.get(k) for k in keep if r.get(k) is not None} for r in runs]
    }


def run_storage(
    name: str,
    root: str,
    storage_options: dict[str, Any] | None,
    args: argparse.Namespace,
    tmp: Path,
    ceiling: Callable[[], dict] | None = None,
    repeats: int | None = None,
    energon_root: str | None = None,
) -> dict[str, dict]:
    """Every contender on one storage. Full passes are repeated `--repeats` times in turn (contender after
    contender, round after round, with `ceiling`, if given, measured once per round too): the machine's speed
    drifts over minutes, and turns spread the drift over all of them. Each reports its median pass."""
    m = load_manifest(root, storage_options=storage_options, shard_format="wds")
    urls = [f"{root}/{s.path}" for s in m.shards]
    total = sum(s.bytes for s in m.shards)
    cfg = CollateConfig.from_manifest(m)
    micro = args.micro_batch
    counter = iter(range(10**6))
    mmpack_caches: list[str] = []

    def mmpack_with(cache_dir: str) -> Iterable[Any]:
        return build_loader(
            root,
            topology=Topology(dp_rank=0, dp_size=1),
            micro_batch_size=micro,
            global_batch_size=micro,
            num_workers=args.workers,
            shard_format="wds",
            num_epochs=1,
            storage_options=storage_options,
            cache_dir=cache_dir,
        )

    def mmpack() -> Iterable[Any]:  # an empty cache folder: first use of the dataset on this machine
        mmpack_caches.append(str(tmp / f"cache-{name}-{next(counter)}"))
        return mmpack_with(mmpack_caches[-1])

    def checked_before() -> Iterable[Any]:  # the cache folder of mmpack's first pass, facts in place
        return mmpack_with(mmpack_caches[0])

    def plain() -> Iterable[Any]:
        return webdataset_loader(urls, cfg, micro, args.workers, storage_options)

    def energon() -> Iterable[Any]:
        return energon_loader(energon_root or root, cfg, micro, args.workers)

    local_files = urls if storage_options is None else []

    def cold() -> None:
        evict_from_page_cache(local_files)

    results: dict[str, dict] = {}
    if local_files:
        results["raw (page cache)"] = raw_read(urls, None)
    cold()
    results["raw"] = raw_read(urls, storage_options)
    cold()
    results["mmpack storage"] = storage_path(
        root, storage_options, str(tmp / f"cache-{name}-{next(counter)}")
    )
    contenders: list[tuple[str, Callable[[], Iterable[Any]]]] = [("webdataset", plain)]
    if (storage_options is None and has_energon(root)) or energon_root is not None:
        contenders.append(("energon", energon))
    contenders += [("mmpack", mmpack), ("mmpack, checked before", checked_before)]
    full: dict[str, list[dict]] = {label: [] for label, _ in contenders}
    ceilings: list[dict] = []
    for _ in range(args.repeats if repeats is None else repeats):
        if ceiling is not None:
            ceilings.append(ceiling())
        for label, make in contenders:
            cold()
            full[label].append(measure(make, total, 0.0, None))
    if ceilings:
        results["decode ceiling"] = median_pass(ceilings)
    for label, make in contenders:
        cold()
        wait = None  # --step-ms 0: no consumer pass
        if args.step_ms > 0:
            wait = measure(make, total, args.step_ms / 1000, args.consumer_batches)["data_wait_fraction"]
        cold()
        memory = peak_memory(make, total)
        results[label] = {**median_pass(full[label]), **memory, "data_wait_fraction": wait}
    results["_dataset"] = {"shards": len(m.shards), "bins": m.num_bins, "bytes": total}
    return results


def run_mixture(dataset: Path, args: argparse.Namespace, tmp: Path) -> dict[str, dict]:
    """A mixture of 3 sources against one dataset, over the same bins: the dataset's folder copied three times
    (three sources, equal shares, one epoch each: 3N bins) and the dataset alone for 3 epochs (3N bins), local
    disk, evicted from the page cache before each pass; passes in turns, medians of bins/s."""
    import shutil

    copies = [tmp / f"mix-source-{i}" for i in range(3)]
    for copy in copies:
        shutil.copytree(dataset, copy)
    m = load_manifest(str(dataset), shard_format="wds")
    n, total = m.num_bins, 3 * sum(s.bytes for s in m.shards)  # both passes read every shard's bytes 3 times
    shards = [str(p) for root in [dataset, *copies] for p in sorted((root / "shards").glob("*"))]
    geometry = {"micro_batch_size": args.micro_batch, "global_batch_size": args.micro_batch}

    def one() -> Iterable[Any]:
        return build_loader(str(dataset), topology=Topology(0, 1), num_workers=args.workers, num_epochs=3,
                            shard_format="wds", cache_dir=str(tmp / "mix-cache-one"), **geometry)  # fmt: skip

    def mixture() -> Iterable[Any]:
        pairs = [(1.0, str(c)) for c in copies]
        return build_loader(pairs, topology=Topology(0, 1), num_workers=args.workers, num_epochs=1,
                            shard_format="wds", cache_dir=str(tmp / "mix-cache-mix"), **geometry)  # fmt: skip

    passes: dict[str, list[dict]] = {"one dataset x 3 epochs": [], "mixture of 3 sources": []}
    for _ in range(args.repeats):
        for label, make in zip(passes, (one, mixture)):
            evict_from_page_cache(shards)
            passes[label].append(measure(make, total, 0.0, None))
    out = {label: median_pass(runs) for label, runs in passes.items()}
    ratio = out["mixture of 3 sources"]["bins_per_s"] / out["one dataset x 3 epochs"]["bins_per_s"]
    out["_mixture"] = {"bins_per_pass": 3 * n, "bins_per_s_ratio": ratio}
    return out


def _fmt(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width},.{digits}f}"


def print_table(all_results: dict[str, dict[str, dict]]) -> None:
    head = (
        f"{'data/storage':13} {'reader':22} {'bins/s':>9} {'MB/s':>8} {'steady bins/s':>13} {'steady MB/s':>11} "
        f"{'1st batch s':>11} {'data wait':>10} {'peak PSS MB':>11} {'(anon+shm)':>10}"
    )
    print(head)
    print("-" * len(head))
    for storage, results in all_results.items():
        for label, r in results.items():
            if label.startswith("_"):
                continue
            wait = r.get("data_wait_fraction")
            print(
                f"{storage:13} {label:22} {_fmt(r.get('bins_per_s'), 9)} {_fmt(r['MB_per_s'], 8)} "
                f"{_fmt(r.get('steady_bins_per_s'), 13)} {_fmt(r.get('steady_MB_per_s'), 11)} "
                f"{_fmt(r.get('time_to_first_batch_s'), 11, 3)} "
                f"{_fmt(None if wait is None else 100 * wait, 9, 2)}{'%' if wait is not None else ' '} "
                f"{_fmt(r.get('peak_pss_MB'), 11, 0)} {_fmt(r.get('peak_pss_anon_shmem_MB'), 10, 0)}"
            )
    print()
    print("ratios (steady state; raw = the storage's sequential read, decode = the CPU ceiling):")
    for storage, results in all_results.items():
        if "_mixture" in results:
            print(f"  {storage:13} mixture/one dataset bins/s {results['_mixture']['bins_per_s_ratio']:.3f}")
            continue
        mm, wds, raw = results["mmpack"], results["webdataset"], results["raw"]
        ceiling = results.get("decode ceiling", {}).get("MB_per_s")
        bound = raw["MB_per_s"] if ceiling is None else min(raw["MB_per_s"], ceiling)
        parts = [
            f"mmpack/webdataset {mm['steady_MB_per_s'] / wds['steady_MB_per_s']:.2f}",
            f"mmpack/raw {mm['steady_MB_per_s'] / raw['MB_per_s']:.2f}",
            f"mmpack storage path/raw {results['mmpack storage']['MB_per_s'] / raw['MB_per_s']:.2f}",
        ]
        if ceiling is not None:
            parts.append(f"mmpack/decode {mm['steady_MB_per_s'] / ceiling:.2f}")
            checked = results.get("mmpack, checked before")
            if checked is not None:
                parts.append(f"mmpack checked before/decode {checked['steady_MB_per_s'] / ceiling:.2f}")
            parts.append(f"mmpack/min(raw, decode) {mm['steady_MB_per_s'] / bound:.2f}")
        if "energon" in results:
            parts.append(
                f"mmpack/energon {mm['steady_MB_per_s'] / results['energon']['steady_MB_per_s']:.2f}"
            )
        for peer in ("webdataset", "energon"):
            if peer in results and results[peer].get("peak_pss_MB") and mm.get("peak_pss_MB"):
                parts.append(f"peak PSS mmpack/{peer} {mm['peak_pss_MB'] / results[peer]['peak_pss_MB']:.2f}")
        print(f"  {storage:13} " + ", ".join(parts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--samples", type=int, default=4000, help="raw synthetic samples of the image-text dataset"
    )
    p.add_argument("--text-samples", type=int, default=150000, help="samples of the text-only dataset")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--bins-per-shard", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--step-ms", type=float, default=400.0, help="consumer time per micro-batch")
    p.add_argument("--consumer-batches", type=int, default=20)
    p.add_argument("--storages", default="local,s3,s3-link")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="full passes per contender (and ceiling), taken in turns; median",
    )
    p.add_argument("--datasets", default="vlm,text", help="which of the two datasets to run (vlm, text)")
    p.add_argument(
        "--link-mb-s", type=float, default=5.0, help="bandwidth of the s3-link storage's link (MB/s, shared)"
    )
    p.add_argument(
        "--mixture",
        action="store_true",
        help="also: a 3-source mixture against one dataset of the same bins (vlm data, local disk)",
    )
    p.add_argument("--mixture-only", action="store_true", help="only the mixture comparison")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument(
        "--tmp-dir",
        default=None,
        help="where the datasets and cache folders go (default: the system's temporary folder)",
    )
    p.add_argument(
        "--no-energon", action="store_true", help="leave Megatron-Energon out even when it is installed"
    )
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="mmpack-bench-loader-", dir=args.tmp_dir) as tmp_name:
        tmp = Path(tmp_name)
        builders = {
            # image-text bins: decoding and patchifying images dominates
            "vlm": lambda: build_packed_dataset(
                tmp / "vlm",
                n_samples=args.samples,
                seq_len=args.seq_len,
                fmt="wds",
                max_bins_per_shard=args.bins_per_shard,
                size_range=(64, 512),
                max_words=120,
            ),
            # text-only bins: shows what the storage and reading path cost without image work
            "text": lambda: build_packed_dataset(
                tmp / "text",
                n_samples=args.text_samples,
                seq_len=args.seq_len,
                fmt="wds",
                max_bins_per_shard=args.bins_per_shard,
                max_words=400,
                record_formats=("text",),
            ),
        }
        wanted = args.datasets.split(",")
        if unknown := set(wanted) - set(builders):
            p.error(f"--datasets: unknown {sorted(unknown)}; choose from {sorted(builders)}")
        if args.mixture_only:
            wanted, args.mixture = ["vlm"], True
        datasets = {name: build() for name, build in builders.items() if name in wanted}
        all_results: dict[str, dict[str, dict]] = {}
        if args.mixture and "vlm" in datasets:
            all_results["vlm/mixture"] = run_mixture(datasets["vlm"], args, tmp)
        storages = [] if args.mixture_only else args.storages.split(",")
        if not args.no_energon and importlib.util.find_spec("megatron.energon") is not None:
            for dataset in datasets.values():
                add_energon_metadata(dataset)
        with contextlib.ExitStack() as servers:  # the S3 server, started at its first use
            s3: Any = None
            for data_name, dataset in datasets.items():
                m = load_manifest(str(dataset), shard_format="wds")
                cfg = CollateConfig.from_manifest(m)
                shards = [(str(dataset / s.path), s.bins) for s in m.shards]  # bin counts from the manifest
                total_bytes = sum(s.bytes for s in m.shards)

                def ceiling(
                    shards: list[tuple[str, int]] = shards,
                    cfg: CollateConfig = cfg,
                    total_bytes: int = total_bytes,
                ) -> dict:
                    return decode_ceiling(shards, cfg, args.micro_batch, args.workers, total_bytes)

                if "local" in storages:  # the ceiling is measured in turns with the passes of each storage
                    all_results[f"{data_name}/local"] = run_storage(
                        "local", str(dataset), None, args, tmp, ceiling
                    )
                if "s3" in storages or "s3-link" in storages:
                    # One server for the run: Energon's MSC reads its config (the endpoint) once per process.
                    s3 = servers.enter_context(moto_s3(own_process=True)) if s3 is None else s3
                    url = s3.upload_folder(dataset, "bench", data_name)
                    if "s3" in storages:
                        all_results[f"{data_name}/s3"] = run_storage(
                            "s3",
                            url,
                            s3.storage_options,
                            args,
                            tmp,
                            ceiling,
                            energon_root=energon_msc_url(s3.endpoint_url, url, tmp)
                            if has_energon(str(dataset))
                            else None,
                        )
                    if "s3-link" in storages:
                        # The same server behind a link slower than decoding: the storage is the bottleneck
                        # (one pass each: the link, not the machine's drift, sets the pace).
                        with link_proxy_process(s3.endpoint_url, args.link_mb_s * 1e6) as proxy:
                            all_results[f"{data_name}/s3-link"] = run_storage(
                                "s3-link", url, s3_storage_options(proxy), args, tmp, ceiling, repeats=1
                            )
    print_table(all_results)
    record = {
        "benchmark": "bench_loader",
        "args": vars(args),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_1m": os.getloadavg()[0],
        },
        "results": all_results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_loader.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {out / 'bench_loader.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
